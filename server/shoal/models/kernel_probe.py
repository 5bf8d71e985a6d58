"""Run a kernel once in a forked child before the process relies on it.

A CPU flag is no proof that an instruction works: a VM may list an instruction set (AMX) and trap
it, and SIGILL cannot be caught in the process that runs the instruction. So a candidate kernel
runs first in a child forked from this process (no re-import: the child has torch loaded); it is
usable when that child exits 0 within the time limit. Where there is no fork (not Linux), the
kernel runs in this process and only a Python exception marks it unusable.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 30.0


def runs_in_child(name: str, probe: Callable[[], None]) -> bool:
    """Whether `probe()` returns normally in a forked child (single-threaded there)."""
    if sys.platform != "linux":
        try:
            probe()
        except Exception:  # noqa: BLE001 - any failure marks the kernel unusable
            logger.exception("kernel %s failed", name)
            return False
        return True
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 1
        try:
            faulthandler.disable()  # a trapped instruction here is an answer, not a crash report
            torch.set_num_threads(1)
            probe()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.waitstatus_to_exitcode(status) != 0:
                logger.warning("kernel %s: probe child ended with %d", name,
                               os.waitstatus_to_exitcode(status))
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    logger.warning("kernel %s: probe child hung for %.0f s", name, PROBE_TIMEOUT_S)
    return False
