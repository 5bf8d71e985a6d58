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


def runs_and_agrees(name: str, agrees: Callable[[], bool], timeout_s: float | None = None
                    ) -> bool:
    """Whether `agrees()` (a kernel against its reference on a small case) returns True in a
    forked child, on one thread, within `timeout_s` (default `PROBE_TIMEOUT_S`; a kernel that
    compiles for long the first time asks for more), and then in this process."""
    def check() -> None:
        if not agrees():
            raise ArithmeticError(f"kernel {name} disagrees with its reference on a small case")

    return runs_in_child(name, check, timeout_s) and agrees()


def runs_in_child(name: str, probe: Callable[[], None], timeout_s: float | None = None) -> bool:
    """Whether `probe()` returns normally in a forked child (single-threaded there)."""
    return runs_in_children({name: probe}, timeout_s)[name]


def runs_in_children(probes: dict[str, Callable[[], None]], timeout_s: float | None = None
                     ) -> dict[str, bool]:
    """Per name, whether its probe returns normally in a child forked for it; the children run
    at the same time (each probe that loads a numba build takes a while; one after another
    they added up to seconds of every rank's start)."""
    if sys.platform != "linux":
        return {name: _runs_here(name, probe) for name, probe in probes.items()}
    children = {_fork(probe): name for name, probe in probes.items()}
    results: dict[str, bool] = {}
    limit = PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + limit
    while children and time.monotonic() < deadline:
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                name = children.pop(pid)
                code = os.waitstatus_to_exitcode(status)
                if code != 0:
                    logger.warning("kernel %s: probe child ended with %d", name, code)
                results[name] = code == 0
        if children:
            time.sleep(0.005)
    for pid, name in children.items():
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        logger.warning("kernel %s: probe child hung for %.0f s", name, limit)
        results[name] = False
    return results


def _fork(probe: Callable[[], None]) -> int:
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
    return pid


def _runs_here(name: str, probe: Callable[[], None]) -> bool:
    try:
        probe()
    except Exception:  # noqa: BLE001 - any failure marks the kernel unusable
        logger.exception("kernel %s failed", name)
        return False
    return True
