"""CPU kernels compiled by numba: each in a serial and a parallel build, cached apart.

A kernel is compiled when first called (a few seconds) and cached under numba's cache directory
(`NUMBA_CACHE_DIR`; the image points it at /tmp) where one is writable, else compiled in every
process. numba names a cache entry after the function and its bytecode, not its options, so the
serial and the parallel build of one function would load each other's code from the cache; each
build compiles a copy of the function under its own name.

The parallel build runs on numba's threading layer, GNU OpenMP where the system has it: a second
runtime beside torch's bundled copy, which starts no thread until a parallel build runs. GNU
OpenMP hangs in a child forked from a process whose pool has run, so whatever runs in a forked
probe child (`shoal.models.kernel_probe`, one thread there) runs the serial build.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import numba
import torch

logger = logging.getLogger(__name__)

# Reassociation lets the sums vectorize; no "nnan"/"ninf": an input may be any float.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

Kernel = Callable[..., None]


def _renamed(kernel: Kernel, suffix: str) -> Kernel:
    twin = types.FunctionType(kernel.__code__, kernel.__globals__, kernel.__name__ + suffix,
                              kernel.__defaults__, kernel.__closure__)
    twin.__qualname__ = kernel.__qualname__ + suffix
    twin.__module__ = kernel.__module__
    twin.__doc__ = kernel.__doc__
    return twin


def _compile(kernel: Kernel, parallel: bool) -> Kernel:
    options = {"parallel": parallel, "nogil": True, "boundscheck": False, "fastmath": FASTMATH}
    build = _renamed(kernel, "_parallel" if parallel else "_serial")
    try:
        return numba.njit(cache=True, **options)(build)
    except RuntimeError:  # no writable cache directory: compile in every process
        logger.info("no numba cache directory is writable; %s compiles per process",
                    kernel.__qualname__)
        return numba.njit(**options)(build)


class Twins:
    """The serial and the parallel build of one kernel (its loops over `numba.prange`)."""

    def __init__(self, kernel: Kernel) -> None:
        self.serial = _compile(kernel, parallel=False)
        self.parallel = _compile(kernel, parallel=True)

    def run(self, *args: Any) -> None:
        """Run on as many threads as torch runs (the serial build where that is one)."""
        threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
        if threads == 1:
            self.serial(*args)
            return
        numba.set_num_threads(threads)
        self.parallel(*args)
