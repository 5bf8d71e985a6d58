"""A decoder layer's small steps between its products, each one pass on the CPU (numba).

At one decode row a layer's norms and rotary embedding are a few thousand floats, yet each
torch op costs its dispatch, which is more than its arithmetic, and the rotary embedding is six
ops and two copies (docs/perf-log.md). Here the residual add and RMSNorm are one pass over
each row, and the rotary embedding turns the query and key heads in place in the fused q/k/v
product's output. SiLU-and-multiply stays with torch: numba's scalar `exp` is slower than
torch's vectorized SiLU at every row count.

The kernels compute the same formulas as the torch ops they replace, summing in another order
(float32 only). `prepare` switches a model's layers to them where its activations are CPU
float32 and the kernels run here: first in a forked child (`shoal.kernels.kernel_probe`; a VM
may list an instruction set LLVM uses and trap it). Serial and parallel builds as
`shoal.kernels.numba_kernels` describes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numba
import numpy as np
import torch
import torch.nn.functional as F

from shoal.kernels.interface import LayerOps
from shoal.kernels.kernel_probe import runs_and_agrees
from shoal.kernels.numba_kernels import Twins


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    """out = x / sqrt(mean(x ** 2) + eps) * weight, per row of x [rows, size]."""
    rows, size = x.shape
    for r in numba.prange(rows):
        total = np.float32(0.0)
        for j in range(size):
            total += x[r, j] * x[r, j]
        scale = np.float32(1.0) / np.sqrt(total / np.float32(size) + eps)
        for j in range(size):
            out[r, j] = x[r, j] * scale * weight[j]


def _add_rms_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: np.float32,
                  out: np.ndarray, summed: np.ndarray) -> None:
    """summed = x + residual; out = the RMSNorm of summed, per row."""
    rows, size = x.shape
    for r in numba.prange(rows):
        total = np.float32(0.0)
        for j in range(size):
            value = x[r, j] + residual[r, j]
            summed[r, j] = value
            total += value * value
        scale = np.float32(1.0) / np.sqrt(total / np.float32(size) + eps)
        for j in range(size):
            out[r, j] = summed[r, j] * scale * weight[j]


def _rotate(heads: np.ndarray, count: np.int64, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate-half RoPE in place on heads [rows, :count, dim] (cos / sin [rows, dim], sin's
    first half negated, as `shoal.kernels.rotary` states them)."""
    rows = heads.shape[0]
    half = heads.shape[2] // 2
    for r in numba.prange(rows):
        for h in range(count):
            x = heads[r, h]
            for i in range(half):
                a = x[i]
                b = x[i + half]
                x[i] = a * cos[r, i] + b * sin[r, i]
                x[i + half] = b * cos[r, i + half] + a * sin[r, i + half]


_rms_norm_kernel = Twins(_rms_norm)
_add_rms_norm_kernel = Twins(_add_rms_norm)
_rotate_kernel = Twins(_rotate)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`F.rms_norm(x, weight.shape, weight, eps)` for x [rows, size]."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _rms_norm_kernel.run(x.numpy(), weight.numpy(), np.float32(eps), out.numpy())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x, residual [rows, size]."""
    x, residual = x.contiguous(), residual.contiguous()
    out, summed = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm_kernel.run(x.numpy(), residual.numpy(), weight.numpy(), np.float32(eps),
                             out.numpy(), summed.numpy())
    return out, summed


def rotate_(heads: torch.Tensor, count: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`heads[:, :count] = apply_rotary(heads[:, :count], cos, sin)` in place; heads [rows,
    all heads, dim] contiguous, cos / sin [rows, 1, dim]."""
    rows = heads.shape[0]
    _rotate_kernel.run(heads.numpy(), np.int64(count), cos.reshape(rows, -1).numpy(),
                       sin.reshape(rows, -1).numpy())


def prepare(ops: Sequence[LayerOps], device: torch.device, dtype: torch.dtype) -> bool:
    """Switch the modules `ops` to these kernels when activations are CPU float32 and the
    kernels run here (else to torch's ops); returns whether they did."""
    enabled = device.type == "cpu" and dtype == torch.float32 and usable()
    for module in ops:
        module.cpu_kernels = enabled
    return enabled


@functools.cache
def usable() -> bool:
    """Whether the kernels run here (their serial builds first in a forked child) and agree with
    the torch ops on a small case."""
    return runs_and_agrees("layer-kernels", _agrees)


def _agrees() -> bool:
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(3, 40, generator=gen), torch.randn(3, 40, generator=gen)
    weight = torch.randn(40, generator=gen)
    normed, summed = add_rms_norm(x, residual, weight, 1e-6)
    heads = torch.randn(3, 5, 8, generator=gen)
    angles = torch.tensor([0.0, 7.0, 300.0])[:, None] * torch.tensor([1.0, 0.1, 0.01, 0.001])
    cos = torch.cat((angles, angles), dim=-1)[:, None].cos()
    sin = torch.cat((-angles, angles), dim=-1)[:, None].sin()
    turned = heads[:, :3]
    expected = torch.cat((turned * cos + torch.cat((turned[..., 4:], turned[..., :4]), dim=-1)
                          * sin, heads[:, 3:]), dim=1)
    rotate_(heads, 3, cos, sin)
    return (torch.allclose(summed, x + residual)
            and torch.allclose(normed, F.rms_norm(x + residual, (40,), weight, 1e-6), atol=1e-5)
            and torch.allclose(rms_norm(x, weight, 1e-6), F.rms_norm(x, (40,), weight, 1e-6),
                               atol=1e-5)
            and torch.allclose(heads, expected, atol=1e-5))
