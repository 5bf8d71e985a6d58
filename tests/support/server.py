"""Start a real `shoal serve` for a test, wait until it is healthy, make sure it is gone after."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from shoal.ports import free_port
from tests.support.wait import wait_until

STARTUP_TIMEOUT_S = 180.0


@dataclass
class RunningServer:
    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    @property
    def openai_url(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def component_pids(self) -> dict[str, int]:
        """Process title → pid of every shoal component this server started."""
        found = {}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                title = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if title.startswith("shoal::"):
                found[title.strip()] = child.pid
        return found

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            return self.proc.wait()


def kill_tree(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def start_server(tmp_dir: Path, *flags: str, env: dict[str, str] | None = None,
                 wait: bool = True, port: int | None = None) -> RunningServer:
    port = port or free_port()
    log_path = tmp_dir / f"server-{port}.log"
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "shoal", "serve", "--port", str(port), *flags],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = RunningServer(proc=proc, base_url=f"http://127.0.0.1:{port}", log_path=log_path)
    if wait:
        wait_healthy(server)
    return server


def wait_healthy(server: RunningServer, timeout: float = STARTUP_TIMEOUT_S) -> None:
    try:
        wait_until(lambda: _is_healthy(server), timeout, "the server answers /health with 200",
                   interval=0.5)
    except TimeoutError as exc:
        server.stop()
        raise TimeoutError(f"{exc}:\n{server.log()}") from None


def _is_healthy(server: RunningServer) -> bool:
    if server.proc.poll() is not None:
        raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()}")
    try:
        return httpx.get(server.base_url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def exit_code_after_sigkill(server: RunningServer, pid: int, within_s: float = 10.0) -> int:
    """SIGKILL one process of `server` (a component); the server's exit code, which must come
    within `within_s` seconds."""
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    code = server.proc.wait(timeout=within_s)
    assert time.monotonic() - started < within_s
    return code


def shoal_processes() -> list[psutil.Process]:
    """Every process whose title says it is a shoal component."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info["cmdline"] or []
        if cmdline and cmdline[0].startswith("shoal::"):
            found.append(p)
    return found
