"""CPU kernels compiled by numba: each in a serial and a parallel build, cached apart.

A kernel is compiled when first called (a few seconds) and cached under numba's cache directory
(`NUMBA_CACHE_DIR`; the image points it at /tmp) where one is writable, else compiled in every
process. numba names a cache entry after the function and its bytecode, not its options, so the
serial and the parallel build of one function would load each other's code from the cache; each
build compiles a copy of the function under its own name.

The parallel build runs on numba's threading layer, GNU OpenMP where the system has it: a second
runtime beside torch's bundled copy, which starts no thread until a parallel build runs. GNU
OpenMP hangs in a child forked from a process whose pool has run, so whatever runs in a forked
probe child (`shoal.kernels.kernel_probe`, one thread there) runs the serial build.

`exp_in_place` is an exp the kernels' loops vectorize (numba from PyPI has no vector math
library). `prefetch_ahead` asks the CPU for a KV pool row ahead of its use: decode attention walks
each request's slots, which lie wherever the allocator put them (a decode step takes one slot per
request, so a request's later tokens are a batch's worth of rows apart), and a row's load waits
on memory unless it was asked for earlier.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import torch
from numba.core import types as numba_types
from numba.extending import intrinsic

from shoal.kernels.vector_ir import prefetch

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


@numba.njit(inline="always")
def exp_in_place(x: np.ndarray, bits: np.ndarray) -> None:
    """x[i] = exp(x[i]) in float32, for the softmax and SiLU of the kernels that inline it:
    within ~1e-7 relative of the exact value (below e^-87 as e^-87, above e^88 as e^88), in loops
    that vectorize, where libm's expf is a call per element (~9x slower). 2^k * exp(r) with k =
    round(x / ln 2), r = x - k ln 2 (in two parts) and exp(r) by Cephes' polynomial; 2^k built
    from its bits in `bits` (as long as x)."""
    for i in range(x.shape[0]):
        v = min(max(x[i], np.float32(-87.0)), np.float32(88.0))
        k = np.floor(v * np.float32(1.4426950408889634) + np.float32(0.5))
        r = v - k * np.float32(0.693359375) - k * np.float32(-2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        x[i] = p * r * r + r + np.float32(1.0)
        bits[i] = (np.int32(k) + np.int32(127)) << np.int32(23)
    scale = bits.view(np.float32)
    for i in range(x.shape[0]):
        x[i] *= scale[i]


# How many slots ahead of the one it reads decode attention asks for a K (or V) row: with K/V
# laid out as serving lays them, 3 ahead hid too little of the wait, 8 and 12 alike most of it
# (docs/perf-log.md).
PREFETCH_AHEAD = 8
# Floats of a 64-byte cache line.
_LINE_FLOATS = 16


@intrinsic
def _prefetch(typingctx: Any, array: numba_types.Type, index: numba_types.Type) -> Any:
    """llvm.prefetch (read, keep in every cache level) of the line holding array.flat[index] of
    a C-contiguous array; a hint that never faults, whatever the address."""
    if not isinstance(array, numba_types.Array) or not isinstance(index, numba_types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        prefetch(builder, builder.gep(data, [args[1]]), locality=3)
        return context.get_dummy_value()

    return numba_types.void(array, index), codegen


@numba.njit(inline="always")
def prefetch_ahead(pool: np.ndarray, slots: np.ndarray, t: int, n: int, head: int) -> None:
    """While reading pool[slots[t], head] of the first `n` slots, ask for the cache lines of the
    row `PREFETCH_AHEAD` slots on (pool: a C-contiguous float32 [slots, heads, dim] KV buffer)."""
    if t + PREFETCH_AHEAD < n:
        base = (slots[t + PREFETCH_AHEAD] * pool.shape[1] + head) * pool.shape[2]
        for offset in range(0, pool.shape[2], _LINE_FLOATS):
            _prefetch(pool, base + offset)
