"""Scheduler watchdog: a batch is running but the forward count has not moved for too long.

On timeout it logs the running batch, dumps the stacks of this rank with py-spy (when present),
writes the termination message and exits 86 (docs/contracts.md, "Exit codes").
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from shoal.lifecycle import ExitCode, fail

logger = logging.getLogger(__name__)

PY_SPY_TIMEOUT_S = 20.0


class Watchdog(threading.Thread):
    def __init__(self, timeout_s: float, progress: Callable[[], tuple[bool, int]],
                 describe: Callable[[], str], component: str, rank: int) -> None:
        super().__init__(name="scheduler-watchdog", daemon=True)
        self.timeout_s = timeout_s
        self.progress = progress      # () -> (a batch is running, forward count)
        self.describe = describe      # () -> text describing the running batch
        self.component = component
        self.rank = rank

    def run(self) -> None:
        last_count = -1
        stalled_since = time.monotonic()
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            busy, count = self.progress()
            now = time.monotonic()
            if not busy or count != last_count:
                last_count, stalled_since = count, now
            elif now - stalled_since >= self.timeout_s:
                self._fire(now - stalled_since, count)

    def _fire(self, stalled_s: float, count: int) -> None:
        detail = (f"no forward progress for {stalled_s:.0f}s (timeout {self.timeout_s:g}s) "
                  f"after {count} forward passes")
        logger.error("Scheduler watchdog timeout on rank %d: %s", self.rank, detail)
        logger.error("running batch:\n%s", self.describe())
        logger.error("stacks:\n%s", py_spy_dump(os.getpid()))
        fail(ExitCode.WATCHDOG, self.component, self.rank, detail)


def py_spy_dump(pid: int) -> str:
    """`py-spy dump` of a process, or the reason it could not run."""
    exe = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if exe is None:
        return "py-spy is not installed; no stack dump"
    try:
        result = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                check=False, timeout=PY_SPY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy could not run: {exc}"
    if result.returncode != 0:
        return f"py-spy failed (exit {result.returncode}): {result.stderr.strip()}"
    return result.stdout
