"""Decode attention on the CPU that reads K/V where they lie in the paged pool.

The torch path (`shoal.engine.attention`) gathers each decode row's K/V into a padded copy and
runs `scaled_dot_product_attention`, whose CPU kernel runs a pair of small GEMMs per request and
head: with the gathers, a large share of a decode step at a few dozen requests
(docs/perf-log.md). This kernel walks each request's
slots in the request -> token table and computes the scores, the softmax and the weighted sum
of V, one task per request and KV head (each K/V row read once for its GQA group: the loops are
`shoal.kernels.attention_tiles`'), in parallel on as many threads as torch runs (numba's
threading layer, GNU OpenMP where the system has it: a second runtime beside torch's bundled
copy, which starts no thread when decode runs on one). It sums in another order
than SDPA, as every float32 kernel of the engine may; float32 only.

The kernel is compiled by numba when first used (`shoal.kernels.numba_kernels`: a few seconds,
then cached). Before this process relies on it, its serial build (the same code and
instructions, no OpenMP: GNU OpenMP hangs in a child forked from a process that ran it) runs in a
forked child (`usable`).
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch
import torch.nn.functional as F

from shoal.kernels.attention_tiles import attend_group
from shoal.kernels.interface import Attention
from shoal.kernels.kernel_probe import runs_and_agrees
from shoal.kernels.numba_kernels import Twins


def _attend(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, table: np.ndarray,
            rows: np.ndarray, seq_lens: np.ndarray, scale: np.float32, out: np.ndarray
            ) -> None:
    """out[r] = softmax(q[r] K^T * scale) V over the slots table[rows[r], :seq_lens[r]]; query
    head h reads KV head h // (heads // kv_heads). One (request, KV head) a task: each K/V row
    is read once for the query heads of its group."""
    requests, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    queries = q.reshape(requests, heads * dim)
    outputs = out.reshape(requests, heads * dim)
    for task in numba.prange(requests * kv_heads):
        r = task // kv_heads
        attend_group(queries, k_pool, v_pool, table, rows[r], r, task % kv_heads, seq_lens[r],
                     group, scale, outputs)


_kernel = Twins(_attend)


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
           rows: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """q [requests, heads, dim] -> the attention output of the same shape: request r's query
    attends to the K/V in slots `table[rows[r], :seq_lens[r]]` of the pool buffers k_pool /
    v_pool [slots, kv_heads, dim]. CPU float32 tensors, int64 indices; on torch's threads (the
    serial build on one). Ask `usable()` before the first call in a process."""
    out = torch.empty(q.shape, dtype=q.dtype)
    args = (q.contiguous().numpy(), k_pool.numpy(), v_pool.numpy(), table.numpy(), rows.numpy(),
            seq_lens.numpy(), np.float32(q.shape[-1] ** -0.5), out.numpy())
    _kernel.run(*args)
    return out


def not_taken(attention: Attention) -> list[str]:
    """What of a layer's declared attention this kernel does not compute (empty: it takes it):
    it attends to every position of the request, scores scaled by 1 / sqrt(head_dim)."""
    checks = [
        (abs(attention.scale * attention.head_dim ** 0.5 - 1) > 1e-6,
         "a score scale other than 1 / sqrt(head_dim)"),
        (attention.sliding_window is not None, "sliding-window attention"),
        (attention.logit_softcap is not None, "soft-capped scores"),
        (attention.heads % attention.kv_heads != 0, "query heads not whole GQA groups"),
    ]
    return [what for missing, what in checks if missing]


@functools.cache
def usable() -> bool:
    """Whether the kernel runs here and agrees with SDPA on a small case (first in a forked
    child, on one thread, so its serial build: a VM may list an instruction set LLVM uses and
    trap it)."""
    return runs_and_agrees("decode-attention", _agrees)


def _agrees() -> bool:
    gen = torch.Generator().manual_seed(0)
    k_pool, v_pool = (torch.randn(40, 2, 16, generator=gen) for _ in range(2))
    table = torch.randperm(40, generator=gen)[:36].view(3, 12)
    rows, seq_lens = torch.tensor([2, 0]), torch.tensor([12, 5])
    q = torch.randn(2, 4, 16, generator=gen)
    out = attend(q, k_pool, v_pool, table, rows, seq_lens)
    for r in range(2):
        slots = table[rows[r], :seq_lens[r]]
        expected = F.scaled_dot_product_attention(
            q[r][:, None], k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1),
            enable_gqa=True)[:, 0]
        if not torch.allclose(out[r], expected, atol=1e-5, rtol=1e-4):
            return False
    return True
