"""The matrix product behind every linear layer, and the weight layout it runs fastest with.

On CPU in float32 the 2-D weights are stored column-major (the logical [out, in] shape is kept,
so loading, sharding and `F.embedding` are unchanged), in one arena backed by transparent huge
pages. Measured on the 2-core AMD EPYC this project runs on (docs/benchmarks.md), SmolLM2-135M's
weights at one thread:
- one row (single-stream decode): MKL's GEMV reading the contiguous [in, out] matrix streams
  the weights ~1.4x faster than `F.linear` on the row-major weight;
- more rows (batched decode, prefill): oneDNN's matmul (the kernel torch's own inductor uses
  for CPU linears) is 1.2-1.7x faster than MKL's SGEMM, which takes a slow path on this CPU;
- huge pages make streaming all weights once per decode step another ~10% faster.
Both are plain float32 products; only the summation order differs from `F.linear`.
A product of at least `LARGE_PRODUCT_ROWS` rows (a prefill) may run on more threads than the
rest of the forward (`large_product_threads`, set by the model runner around each forward): it is
compute-bound and one barrier long, so a thread the OS preempts for the api delays it a little,
where the many small ops of a decode step would stall at every barrier (docs/operations.md).
Elsewhere (CUDA, other dtypes) this is `F.linear` on the usual row-major weight.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
LARGE_PRODUCT_ROWS = 256


# (base, large) torch threads inside `large_product_threads`; None: leave the count alone
_product_threads: ContextVar[tuple[int, int] | None] = ContextVar("product_threads",
                                                                   default=None)


@contextmanager
def large_product_threads(base: int, large: int) -> Iterator[None]:
    """Within this block (one forward, in the thread that runs it), a product of
    `LARGE_PRODUCT_ROWS` rows or more runs on `large` torch threads and then returns to `base`,
    the thread count of everything else."""
    assert _product_threads.get() is None, "large_product_threads does not nest"
    token = _product_threads.set((base, large) if large > base else None)
    try:
        yield
    finally:
        _product_threads.reset(token)


def _column_major(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.stride(0) == 1 and weight.shape[1] > 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for 2-D `x`, through oneDNN for a column-major CPU weight
    and more than one row."""
    if _ONEDNN and x.shape[0] > 1 and x.device.type == "cpu" and _column_major(weight):
        threads = _product_threads.get() if x.shape[0] >= LARGE_PRODUCT_ROWS else None
        if threads is None:
            return _onednn_linear(x, weight, bias)
        base, large = threads
        torch.set_num_threads(large)
        try:
            return _onednn_linear(x, weight, bias)
        finally:
            torch.set_num_threads(base)
    return F.linear(x, weight, bias)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def use_fast_layout(model: nn.Module) -> None:
    """Move the 2-D float32 CPU weights of `model` into one huge-page arena, column-major; a
    no-op elsewhere. Tied weights stay tied: each parameter object moves once."""
    params = [p for p in model.parameters()
              if p.dim() == 2 and p.device.type == "cpu" and p.dtype == torch.float32]
    if not params:
        return
    arena = _huge_page_arena(sum(p.numel() for p in params))
    offset = 0
    for param in params:
        rows, cols = param.shape
        column_major = arena[offset:offset + param.numel()].view(cols, rows)
        column_major.copy_(param.data.t())
        param.data = column_major.t()
        offset += param.numel()


def _huge_page_arena(numel: int) -> torch.Tensor:
    """An untouched float32 buffer of `numel` elements whose pages the kernel is asked to back
    with transparent huge pages (on Linux; plain memory where that is refused)."""
    buffer = torch.empty(numel + _HUGE_PAGE // 4, dtype=torch.float32)
    start = -buffer.data_ptr() % _HUGE_PAGE
    arena = buffer[start // 4:start // 4 + numel]
    if sys.platform == "linux":
        length = numel * 4 // _HUGE_PAGE * _HUGE_PAGE
        libc = ctypes.CDLL(None, use_errno=True)
        if length and libc.madvise(ctypes.c_void_p(arena.data_ptr()), ctypes.c_size_t(length),
                                   _MADV_HUGEPAGE) != 0:
            logger.info("no transparent huge pages for the weights (madvise: errno %d)",
                        ctypes.get_errno())
    return arena
