"""Image smoke test: the real image, built offline on this CPU machine, in a real container.

Only `make image-smoke` runs this (it builds the image first and passes SHOAL_SMOKE_IMAGE);
`make test` deselects the `image_smoke` marker. Containers use the host network and bind only
to 127.0.0.1; nothing else is reached.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from shoal.ports import free_port
from tests.support.generate import ask_capital_of_france
from tests.support.termination import termination_message
from tests.support.wait import wait_until

pytestmark = pytest.mark.image_smoke

IMAGE = os.environ.get("SHOAL_SMOKE_IMAGE", "shoal:smoke")
HEALTHY_TIMEOUT_S = 180
SHOAL_UID = 10001
# How the image is meant to run (docs/image.md): a read-only root filesystem with a tmpfs for
# the run directory, no capabilities, no privilege escalation.
HARDENING = ("--read-only", "--tmpfs", "/tmp:rw,nosuid,nodev,mode=1777", "--cap-drop", "ALL",
             "--security-opt", "no-new-privileges")
# Runs inside the container (the image's own Python and psutil): the component processes.
LIST_PROCESSES = ("import json, psutil; print(json.dumps([(p.info['pid'], p.info['uids'].real, "
                  "' '.join(p.info['cmdline'] or []).strip()) for p in "
                  "psutil.process_iter(['pid', 'uids', 'cmdline'])]))")
# Every capability set of every process in the container, as numbers.
READ_CAPABILITIES = ("import glob, json; print(json.dumps([int(line.split()[1], 16) for path in "
                     "glob.glob('/proc/[0-9]*/status') for line in open(path) "
                     "if line.startswith('Cap')]))")


def docker(*args: str, timeout: float = 60, check: bool = True
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                          check=check)


@dataclass
class Container:
    name: str
    base_url: str
    termination_log: Path

    def state(self, field: str) -> str:
        return docker("inspect", "--format", "{{" + field + "}}", self.name).stdout.strip()

    def processes(self) -> list[tuple[int, int, str]]:
        out = docker("exec", self.name, "python", "-c", LIST_PROCESSES).stdout
        return [tuple(p) for p in json.loads(out)]

    def capabilities(self) -> set[int]:
        """The values of every capability set (inheritable, permitted, effective, bounding,
        ambient) of every process: {0} when none is held anywhere."""
        out = docker("exec", self.name, "python", "-c", READ_CAPABILITIES).stdout
        return set(json.loads(out))

    def write_outside_tmp(self) -> str:
        return docker("exec", self.name, "touch", "/opt/shoal/x", "/home/shoal/x",
                      check=False).stderr

    def logs(self) -> str:
        result = docker("logs", self.name, check=False)
        return result.stdout + result.stderr


@pytest.fixture(scope="module")
def image() -> str:
    if docker("image", "inspect", IMAGE, check=False).returncode != 0:
        pytest.fail(f"image {IMAGE!r} is not built: run `make image-smoke`")
    return IMAGE


@pytest.fixture
def run_container(image: str, tmp_path: Path) -> Iterator:
    names = []

    def run(*flags: str, env: dict[str, str] | None = None) -> Container:
        name = f"shoal-smoke-{uuid.uuid4().hex[:8]}"
        port = free_port()
        termination_log = tmp_path / f"{name}.termination-log"
        termination_log.touch(mode=0o666)
        termination_log.chmod(0o666)  # written by the image's non-root user
        env = {"SHOAL_HOST": "127.0.0.1", "SHOAL_PORT": str(port), **(env or {})}
        docker("run", "--detach", "--name", name, "--network", "host", "--health-interval", "2s",
               *HARDENING, "--volume", f"{termination_log}:/dev/termination-log",
               *[f"--env={key}={value}" for key, value in env.items()], image, *flags)
        names.append(name)
        container = Container(name, f"http://127.0.0.1:{port}", termination_log)
        _wait_healthy(container)
        return container

    yield run
    for name in names:
        docker("rm", "--force", name, check=False)


def _wait_healthy(container: Container) -> None:
    """Docker's HEALTHCHECK (image/healthcheck.py on /health) must say healthy."""
    def healthy() -> bool:
        if container.state(".State.Status") != "running":
            pytest.fail(f"container stopped during startup:\n{container.logs()}")
        return container.state(".State.Health.Status") == "healthy"

    try:
        wait_until(healthy, HEALTHY_TIMEOUT_S, "docker reports the container healthy", interval=1)
    except TimeoutError as exc:
        pytest.fail(f"{exc}:\n{container.logs()}")


def test_serves_then_exits_with_the_killed_schedulers_code(run_container) -> None:
    container = run_container("--max-total-tokens", "4096", env={"SHOAL_TP": "2"})
    processes = container.processes()
    titles = {cmd for _, _, cmd in processes if cmd.startswith("shoal::")}
    assert titles == {"shoal::api", "shoal::detokenizer", "shoal::scheduler_TP0",
                      "shoal::scheduler_TP1"}
    assert any("supervisor.supervisord" in cmd for _, _, cmd in processes)
    assert {uid for _, uid, _ in processes} == {SHOAL_UID}  # nothing runs as root
    assert container.state(".HostConfig.ReadonlyRootfs") == "true"
    assert container.capabilities() == {0}
    assert "Read-only file system" in container.write_outside_tmp()
    assert "image/entrypoint.py" in next(cmd for pid, _, cmd in processes if pid == 1)

    assert "Paris" in ask_capital_of_france(container.base_url)

    victim = next(pid for pid, _, cmd in processes if cmd == "shoal::scheduler_TP1")
    docker("exec", container.name, "python", "-c", f"import os; os.kill({victim}, 9)")
    started = time.monotonic()
    code = int(docker("wait", container.name, timeout=30).stdout.strip())
    assert time.monotonic() - started < 10
    assert code == 137 == int(container.state(".State.ExitCode"))
    message = termination_message(container.termination_log)
    assert (message.component, message.rank, message.exit_code) == ("scheduler_TP1", 1, 137)
    assert "killed by SIGKILL" in message.detail


def test_docker_stop_drains_in_flight_requests_and_exits_zero(run_container) -> None:
    container = run_container("--max-total-tokens", "4096")
    result: dict = {}

    def generate() -> None:
        r = httpx.post(container.base_url + "/generate", timeout=120, json={
            "text": "Once upon a time", "sampling_params": {
                "max_new_tokens": 64, "temperature": 0, "ignore_eos": True}})
        result["status"], result["body"] = r.status_code, r.json()

    client = threading.Thread(target=generate)
    client.start()
    wait_until(lambda: httpx.get(container.base_url + "/server_info").json()[
        "num_running_requests"] > 0, timeout=30, what="the request reaches the server",
        interval=0.05)
    stop = docker("stop", "--time", "60", container.name, timeout=90)
    client.join(timeout=30)
    assert stop.returncode == 0
    assert int(container.state(".State.ExitCode")) == 0
    assert result["status"] == 200
    assert result["body"]["meta_info"]["completion_tokens"] == 64
    assert not container.termination_log.read_text().strip()
