"""Every exit code of docs/contracts.md, raised for real: each code maps to the tests that trigger
it, here (real components, cheap: no server around them) or where a whole server is needed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from shoal import lifecycle
from shoal.ipc.messages import ComponentReady
from shoal.ipc.sockets import Endpoints, pull_socket, recv
from shoal.lifecycle import ExitCode, Reason
from shoal.ports import free_port
from tests.support.termination import termination_message

REPO = Path(__file__).resolve().parents[2]
SIGKILLED = 128 + signal.SIGKILL

# code -> the tests that make a component or a server exit with it
RAISED_BY = {
    ExitCode.COMPLETED: [
        "tests/e2e/test_exit_codes.py::test_sigterm_ends_a_component_with_0",
        "tests/e2e/test_serve_processes.py::test_sigterm_drains_in_flight_requests",
    ],
    ExitCode.CRASH: [
        "tests/e2e/test_exit_codes.py::test_an_injected_crash_ends_a_component_with_1",
        "tests/unit/test_lifecycle.py::test_classify_exit_status",  # exit 0 nobody asked for
    ],
    ExitCode.PEER_LOST: [
        "tests/e2e/test_exit_codes.py::test_a_rank_whose_peer_dies_ends_with_75",
        "tests/unit/test_lifecycle.py::test_a_component_started_after_its_parent_died_is_peer_lost",
    ],
    ExitCode.WATCHDOG: [
        "tests/e2e/test_multirank.py::test_hung_rank_trips_the_watchdog",
        "tests/e2e/test_image_entrypoint.py::"
        "test_hung_rank_trips_the_watchdog_and_the_entrypoint_exits_86",
    ],
    ExitCode.CONSENSUS: [
        "tests/e2e/test_multirank.py::test_diverging_rank_fails_the_consensus_check",
    ],
    ExitCode.STARTUP_FAILED: [
        "tests/e2e/test_exit_codes.py::test_a_configuration_that_cannot_work_exits_88",
        "tests/e2e/test_exit_codes.py::test_the_entrypoint_refuses_a_bad_configuration_with_88",
        "tests/e2e/test_exit_codes.py::test_a_component_whose_model_cannot_load_exits_88",
        "tests/unit/test_supervisord_conf.py::test_a_program_that_cannot_start_is_a_startup_failure",
    ],
    SIGKILLED: [
        "tests/e2e/test_serve_processes.py::test_sigkill_of_any_component_ends_the_server",
        "tests/e2e/test_multirank.py::test_sigkill_of_any_process_of_a_tp2_server",
        "tests/e2e/test_image_entrypoint.py::test_sigkill_of_a_rank_ends_the_entrypoint_with_its_code",
    ],
}


def _codes_of_table(text: str) -> set[int]:
    """The codes in the first column of a markdown table (`128+N` stands for 137)."""
    codes = set()
    for cell in re.findall(r"^\|\s*([0-9+N]+)\s*\|", text, re.MULTILINE):
        codes.add(SIGKILLED if cell == "128+N" else int(cell))
    return codes


def test_every_documented_code_is_raised_by_a_test() -> None:
    contracts = (REPO / "docs" / "contracts.md").read_text()
    section = contracts.split("## Exit codes and the termination message")[1].split("\n## ")[0]
    assert _codes_of_table(section) == set(RAISED_BY)
    assert _codes_of_table(lifecycle.__doc__ or "") == set(RAISED_BY)
    for node_ids in RAISED_BY.values():
        for node_id in node_ids:
            path, name = node_id.split("::")
            source = (REPO / path).read_text()
            assert re.search(rf"^def {name}\(", source, re.MULTILINE), f"{node_id} is gone"


# -- components and commands on their own -----------------------------------------------------


def _env(log: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "SHOAL_TERMINATION_LOG": str(log), **extra}


def _shoal(*argv: str) -> list[str]:
    return [sys.executable, "-m", "shoal", *argv]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def api_socket(run_dir: Path) -> Iterator[zmq.Socket]:
    """The api's PULL socket, where components announce themselves (`ComponentReady`)."""
    ctx = zmq.Context()
    sock = pull_socket(ctx, Endpoints(str(run_dir)).api_input)
    yield sock
    ctx.destroy(linger=0)


def _wait_ready(sock: zmq.Socket, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    assert sock.poll(int(timeout_s * 1000)), f"no ComponentReady (exit {proc.poll()})"
    assert isinstance(recv(sock), ComponentReady)


def _component(run_dir: Path, log: Path, role: str, *flags: str,
               **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(_shoal("component", role, "--run-dir", str(run_dir), *flags),
                            env=_env(log, **env))


@pytest.mark.parametrize("argv,env", [
    (("--tp", "0"), {}),
    (("--tp", "x"), {}),
    (("--schedule-policy", "random"), {}),
    ((), {"SHOAL_PORT": "not-a-port"}),
], ids=["impossible-value", "not-a-number", "not-a-choice", "bad-env"])
def test_a_configuration_that_cannot_work_exits_88(tmp_path: Path, argv: tuple[str, ...],
                                                   env: dict[str, str]) -> None:
    log = tmp_path / "termination-log"
    log.write_text('{"reason": "watchdog", "component": "x", "rank": 0, "exit_code": 86}\n')
    result = subprocess.run(_shoal("serve", *argv), env=_env(log, **env), capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == ExitCode.STARTUP_FAILED, result.stderr
    message = termination_message(log)  # written, and not shadowed by the stale one
    assert (message.reason, message.component, message.exit_code) == (
        Reason.STARTUP_FAILED, "serve", ExitCode.STARTUP_FAILED)
    assert "configuration error" in result.stderr


def test_the_entrypoint_refuses_a_bad_configuration_with_88(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    result = subprocess.run([sys.executable, str(REPO / "image" / "entrypoint.py"), "--tp", "0"],
                            env=_env(log), capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == ExitCode.STARTUP_FAILED, result.stderr
    message = termination_message(log)
    assert (message.reason, message.component) == (Reason.STARTUP_FAILED, "entrypoint")


@pytest.mark.parametrize("role,name", [("api", "api"), ("detokenizer", "detokenizer"),
                                       ("scheduler", "scheduler_TP0")])
def test_a_component_whose_model_cannot_load_exits_88(tmp_path: Path, run_dir: Path, role: str,
                                                      name: str) -> None:
    log, missing = tmp_path / "termination-log", tmp_path / "no-such-model"
    proc = _component(run_dir, log, role, "--model-path", str(missing))
    assert proc.wait(timeout=120) == ExitCode.STARTUP_FAILED
    message = termination_message(log)
    assert (message.reason, message.component) == (Reason.STARTUP_FAILED, name)
    assert str(missing) in message.detail


def test_sigterm_ends_a_component_with_0(tmp_path: Path, run_dir: Path,
                                         api_socket: zmq.Socket) -> None:
    log = tmp_path / "termination-log"
    proc = _component(run_dir, log, "detokenizer")
    try:
        _wait_ready(api_socket, proc, timeout_s=120)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == ExitCode.COMPLETED
    finally:
        proc.kill()
    assert not log.exists() or not log.read_text().strip()


def test_an_injected_crash_ends_a_component_with_1(tmp_path: Path, run_dir: Path,
                                                   api_socket: zmq.Socket) -> None:
    log = tmp_path / "termination-log"
    proc = _component(run_dir, log, "detokenizer",
                      SHOAL_FAULT="crash:component=detokenizer:after_s=1")
    try:
        assert proc.wait(timeout=120) == ExitCode.CRASH
    finally:
        proc.kill()
    message = termination_message(log)
    assert (message.reason, message.component, message.rank) == (Reason.CRASH, "detokenizer",
                                                                  None)
    assert "injected by SHOAL_FAULT" in message.detail


def test_a_rank_whose_peer_dies_ends_with_75(tmp_path: Path, run_dir: Path,
                                             api_socket: zmq.Socket) -> None:
    """Two scheduler ranks on their own; rank 1 is killed while rank 0 idles, whose next
    broadcast to it fails: gloo's "Connection closed by peer" becomes `PeerLost`."""
    log = tmp_path / "termination-log"
    flags = ("--tp", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}",
             "--max-total-tokens", "256", "--context-length", "256",
             "--max-running-requests", "4")
    ranks = [_component(run_dir, log, "scheduler", "--tp-rank", str(rank), *flags)
             for rank in (0, 1)]
    try:
        _wait_ready(api_socket, ranks[0], timeout_s=300)  # both loaded: rank 0 waits for rank 1
        ranks[1].kill()
        assert ranks[0].wait(timeout=60) == ExitCode.PEER_LOST
    finally:
        for proc in ranks:
            proc.kill()
    message = termination_message(log)
    assert (message.reason, message.component, message.rank) == (Reason.PEER_LOST,
                                                                  "scheduler_TP0", 0)
    assert message.detail.startswith("a peer rank failed: broadcast")
