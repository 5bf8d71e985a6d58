"""Decode attention's loops (`shoal.kernels.attention_tiles`, run through
`shoal.kernels.decode_attention.attend`) against SDPA: head dimensions that are whole vectors
(the IR tiles) and one that is not (numba's loops), GQA groups smaller and larger than the tile's
block of heads, and contexts around a block of scores and odd ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.kernels import decode_attention
from shoal.kernels.interface import Attention
from shoal.kernels.vector_ir import VECTOR


@pytest.mark.parametrize("dim", [VECTOR, 4 * VECTOR, 12])
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (9, 3), (10, 2), (8, 1)])
def test_decode_attention_matches_sdpa(dim: int, heads: int, kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(dim * 100 + heads)
    seq_lens = torch.tensor([1, VECTOR - 1, VECTOR, VECTOR + 1, 2 * VECTOR + 7, 40])
    requests, slots = len(seq_lens), 500
    k_pool, v_pool = (torch.randn(slots, kv_heads, dim, generator=gen) for _ in range(2))
    table = torch.randperm(slots, generator=gen)[:(requests + 2) * 60].view(requests + 2, 60)
    rows = torch.randperm(requests + 2, generator=gen)[:requests]
    q = torch.randn(requests, heads, dim, generator=gen)
    assert decode_attention.usable()
    out = decode_attention.attend(q, k_pool, v_pool, table, rows, seq_lens)
    for r in range(requests):
        used = table[rows[r], :seq_lens[r]]
        expected = F.scaled_dot_product_attention(
            q[r][:, None], k_pool[used].transpose(0, 1), v_pool[used].transpose(0, 1),
            enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[r], expected, atol=1e-5, rtol=1e-4)


def test_decode_attention_takes_only_what_it_computes() -> None:
    plain = Attention(heads=9, kv_heads=3, head_dim=64, rotary_dim=64, scale=64 ** -0.5)
    assert decode_attention.not_taken(plain) == []
    assert decode_attention.not_taken(Attention(9, 3, 64, 64, 0.1, sliding_window=512,
                                                logit_softcap=30.0)) == [
        "a score scale other than 1 / sqrt(head_dim)", "sliding-window attention",
        "soft-capped scores"]
