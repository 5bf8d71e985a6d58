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
                 wait: bool = True) -> RunningServer:
    port = free_port()
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
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise TimeoutError(f"server not healthy after {timeout}s:\n{server.log()}")


def shoal_processes() -> list[psutil.Process]:
    """Every process whose title says it is a shoal component."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info["cmdline"] or []
        if cmdline and cmdline[0].startswith("shoal::"):
            found.append(p)
    return found
