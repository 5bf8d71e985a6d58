"""Small-batch products on the CPU by kernels of shoal's own, for int8 weights
(`--quantization w8a16`) and float32 ones.

A decode step of a few rows streams every weight once, so its products cost what reading the
weights costs: int8 weights are a quarter of float32's bytes, but torch's `_weight_int8pack_mm`
runs one row no faster than float32 on a host without bfloat16 instructions (it converts the
activations to bfloat16). These kernels read each int8 weight row once, widen it to float32 in
registers and multiply it with float32 activations, summing in float32; the per-output-channel
scale is applied to each sum, and one row runs in well under float32's time
(docs/perf-log.md).

Two blockings, chosen per row bucket by measurement (`shoal.kernels.linear_kernels`): `by_rows`
takes one output channel and four rows at a time (four independent sums hide the FMA latency at
few rows), `by_pairs` two channels and four rows (each activation load feeds two sums: ahead from
~16 rows).

The same code takes a float32 weight (numba compiles it for that dtype; the scale is then ones):
at a few rows it can beat OpenBLAS and MKL, which pack the weight for every product
(docs/perf-log.md); the measurement at load decides where it is used.

They are compiled by numba (`shoal.kernels.numba_kernels`) and run in parallel over output
channels on torch's thread count, serially where that is one (as in a forked probe child).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from shoal.kernels.numba_kernels import Twins


def _by_rows(x: np.ndarray, w: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    """out [m, n] = (x [m, k] . w [n, k]) * scale [n]: one channel, four rows at a time."""
    rows, depth = x.shape
    for n in numba.prange(w.shape[0]):
        s = scale[n]
        m = 0
        while m + 4 <= rows:
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            for k in range(depth):
                wk = np.float32(w[n, k])
                a0 += x[m, k] * wk
                a1 += x[m + 1, k] * wk
                a2 += x[m + 2, k] * wk
                a3 += x[m + 3, k] * wk
            out[m, n] = a0 * s
            out[m + 1, n] = a1 * s
            out[m + 2, n] = a2 * s
            out[m + 3, n] = a3 * s
            m += 4
        while m < rows:
            a0 = np.float32(0.0)
            for k in range(depth):
                a0 += x[m, k] * np.float32(w[n, k])
            out[m, n] = a0 * s
            m += 1


def _by_pairs(x: np.ndarray, w: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    """As `_by_rows`, two channels and four rows at a time (an odd last channel alone)."""
    rows, depth = x.shape
    channels = w.shape[0]
    for pair in numba.prange((channels + 1) // 2):
        n = 2 * pair
        last = min(n + 2, channels)
        m = 0
        while m + 4 <= rows and last == n + 2:
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            b0 = np.float32(0.0)
            b1 = np.float32(0.0)
            b2 = np.float32(0.0)
            b3 = np.float32(0.0)
            for k in range(depth):
                u = np.float32(w[n, k])
                v = np.float32(w[n + 1, k])
                x0 = x[m, k]
                x1 = x[m + 1, k]
                x2 = x[m + 2, k]
                x3 = x[m + 3, k]
                a0 += x0 * u
                a1 += x1 * u
                a2 += x2 * u
                a3 += x3 * u
                b0 += x0 * v
                b1 += x1 * v
                b2 += x2 * v
                b3 += x3 * v
            out[m, n] = a0 * scale[n]
            out[m + 1, n] = a1 * scale[n]
            out[m + 2, n] = a2 * scale[n]
            out[m + 3, n] = a3 * scale[n]
            out[m, n + 1] = b0 * scale[n + 1]
            out[m + 1, n + 1] = b1 * scale[n + 1]
            out[m + 2, n + 1] = b2 * scale[n + 1]
            out[m + 3, n + 1] = b3 * scale[n + 1]
            m += 4
        for c in range(n, last):
            for r in range(m, rows):
                a0 = np.float32(0.0)
                for k in range(depth):
                    a0 += x[r, k] * np.float32(w[c, k])
                out[r, c] = a0 * scale[c]


@numba.njit(inline="always")
def four_by_three(x: np.ndarray, w: np.ndarray, n: int, m: int, scale: np.ndarray,
                  out: np.ndarray, col: int) -> None:
    """out[m + r, col + c] = (x[m + r] . w[n + c]) * scale[n + c] for r < 3 and c < 4: twelve
    sums, each weight load feeding three and each activation load four (inlined, numba IR, into
    the kernel that blocks by it, `by_quads`)."""
    depth = x.shape[1]
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    b0 = np.float32(0.0)
    b1 = np.float32(0.0)
    b2 = np.float32(0.0)
    c0 = np.float32(0.0)
    c1 = np.float32(0.0)
    c2 = np.float32(0.0)
    d0 = np.float32(0.0)
    d1 = np.float32(0.0)
    d2 = np.float32(0.0)
    for k in range(depth):
        u0 = np.float32(w[n, k])
        u1 = np.float32(w[n + 1, k])
        u2 = np.float32(w[n + 2, k])
        u3 = np.float32(w[n + 3, k])
        x0 = x[m, k]
        x1 = x[m + 1, k]
        x2 = x[m + 2, k]
        a0 += x0 * u0
        a1 += x1 * u0
        a2 += x2 * u0
        b0 += x0 * u1
        b1 += x1 * u1
        b2 += x2 * u1
        c0 += x0 * u2
        c1 += x1 * u2
        c2 += x2 * u2
        d0 += x0 * u3
        d1 += x1 * u3
        d2 += x2 * u3
    out[m, col] = a0 * scale[n]
    out[m + 1, col] = a1 * scale[n]
    out[m + 2, col] = a2 * scale[n]
    out[m, col + 1] = b0 * scale[n + 1]
    out[m + 1, col + 1] = b1 * scale[n + 1]
    out[m + 2, col + 1] = b2 * scale[n + 1]
    out[m, col + 2] = c0 * scale[n + 2]
    out[m + 1, col + 2] = c1 * scale[n + 2]
    out[m + 2, col + 2] = c2 * scale[n + 2]
    out[m, col + 3] = d0 * scale[n + 3]
    out[m + 1, col + 3] = d1 * scale[n + 3]
    out[m + 2, col + 3] = d2 * scale[n + 3]


def _by_quads(x: np.ndarray, w: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    """As `_by_rows`, four channels and three rows at a time (twelve sums: each weight load feeds
    three, each activation load four); a last row or two with four channels at a time, the last
    channels (fewer than four) one at a time."""
    rows, depth = x.shape
    channels = w.shape[0]
    for quad in numba.prange((channels + 3) // 4):
        n = 4 * quad
        if n + 4 > channels:
            for c in range(n, channels):
                for r in range(rows):
                    a0 = np.float32(0.0)
                    for k in range(depth):
                        a0 += x[r, k] * np.float32(w[c, k])
                    out[r, c] = a0 * scale[c]
        else:
            m = 0
            while m + 3 <= rows:
                four_by_three(x, w, n, m, scale, out, n)
                m += 3
            while m < rows:
                a0 = np.float32(0.0)
                b0 = np.float32(0.0)
                c0 = np.float32(0.0)
                d0 = np.float32(0.0)
                for k in range(depth):
                    x0 = x[m, k]
                    a0 += x0 * np.float32(w[n, k])
                    b0 += x0 * np.float32(w[n + 1, k])
                    c0 += x0 * np.float32(w[n + 2, k])
                    d0 += x0 * np.float32(w[n + 3, k])
                out[m, n] = a0 * scale[n]
                out[m, n + 1] = b0 * scale[n + 1]
                out[m, n + 2] = c0 * scale[n + 2]
                out[m, n + 3] = d0 * scale[n + 3]
                m += 1


_rows = Twins(_by_rows)
_pairs = Twins(_by_pairs)
_quads = Twins(_by_quads)


def _product(kernel: Twins, x: torch.Tensor, weight: np.ndarray, scale: np.ndarray
             ) -> torch.Tensor:
    floats = x.dtype == torch.float32
    activations = (x if floats else x.to(torch.float32)).contiguous().numpy()
    out = np.empty((x.shape[0], weight.shape[0]), np.float32)
    kernel.run(activations, weight, scale, out)
    return torch.from_numpy(out) if floats else torch.from_numpy(out).to(x.dtype)


def by_rows(x: torch.Tensor, weight: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """x [rows, in] (any float dtype) . weight [out, in] (int8 or float32, row-major) * float32
    scale [out] -> [rows, out] in x's dtype, one channel and four rows at a time."""
    return _product(_rows, x, weight, scale)


def by_pairs(x: torch.Tensor, weight: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """As `by_rows`, two channels and four rows at a time."""
    return _product(_pairs, x, weight, scale)


def by_quads(x: torch.Tensor, weight: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """As `by_rows`, four channels and three rows at a time."""
    return _product(_quads, x, weight, scale)
