"""The cluster's components as child processes: started with a log file, waited for, stopped
by pid."""

from __future__ import annotations

import ctypes
import functools
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

LOG_TAIL_LINES = 40
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl  # looked up before any fork


class ComponentFailed(RuntimeError):
    pass


@dataclass
class Component:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def failure(self, what: str) -> ComponentFailed:
        return ComponentFailed(
            f"{self.name} {what}; the end of {self.log_path}:\n{self.log_tail()}")

    def check_running(self) -> None:
        if self.proc.poll() is not None:
            raise self.failure(f"exited with {self.proc.returncode}")

    def wait_ready(self, is_ready: Callable[[], bool], timeout: float) -> None:
        """Poll `is_ready` until it holds; fail with the log's tail if the process ends first."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_running()
            if is_ready():
                return
            if time.monotonic() > deadline:
                raise self.failure(f"not ready after {timeout:.0f} s")
            time.sleep(0.1)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`: only this process, which this session started."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _signal_on_parent_death(signum: int) -> None:
    _prctl(_PR_SET_PDEATHSIG, signum)


def start_component(name: str, argv: Sequence[str], log_path: Path, *,
                    cwd: Path | None = None, env: dict[str, str] | None = None,
                    parent_death_signal: int = signal.SIGKILL) -> Component:
    """Start `argv` in its own session (a terminal's Ctrl-C reaches only the session), logging to
    `log_path`; the kernel sends it `parent_death_signal` when the thread that started it ends."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
            env=env, start_new_session=True,
            # NOTE: the child only calls prctl, which takes no lock another thread could hold
            preexec_fn=functools.partial(_signal_on_parent_death, parent_death_signal))  # noqa: PLW1509
    return Component(name=name, proc=proc, log_path=log_path)
