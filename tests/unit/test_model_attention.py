"""TorchNativeBackend against a plain per-request softmax attention over the same K/V, with
decode rows attending in place (`shoal.kernels.decode_attention`) and through SDPA, for full
layers and for layers with a scale, a sliding window and soft-capped scores."""

from __future__ import annotations

import pytest
import torch

from shoal.engine.attention import TorchNativeBackend
from shoal.engine.kv_pool import KVPool, ReqToTokenPool
from shoal.kernels import decode_attention
from shoal.models.attention_backend import FULL_ATTENTION, LayerAttention
from shoal.models.forward_batch import ForwardBatch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
               how: LayerAttention) -> torch.Tensor:
    """q [new, heads, dim] attending k/v [prefix + new, kv_heads, dim], causally (and within
    how's window, scaled and capped as it says)."""
    group = NUM_HEADS // NUM_KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = HEAD_DIM ** -0.5 if how.scale is None else how.scale
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if how.softcap is not None:
        scores = how.softcap * torch.tanh(scores / how.softcap)
    keys, queries = torch.arange(k.shape[0])[None, :], prefix_len + torch.arange(q.shape[0])
    allowed = keys <= queries[:, None]
    if how.sliding_window is not None:
        allowed &= keys > queries[:, None] - how.sliding_window
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("how", [
    FULL_ATTENTION, LayerAttention(scale=0.2), LayerAttention(sliding_window=3),
    LayerAttention(scale=0.2, sliding_window=4, softcap=1.5)],
    ids=["full", "scaled", "window", "window-capped"])
@pytest.mark.parametrize("in_place_decode", [True, False], ids=["in-place", "sdpa"])
@pytest.mark.parametrize("extend_lens, prefix_lens", [
    ([1, 4, 1, 6], [5, 3, 9, 0]),   # decode and extend rows interleaved
    ([1, 1, 1], [4, 0, 11]),        # all decode
    ([7], [0]),                     # a single prefill
    # whole prompts: two adjacent of one length share an SDPA call, the others do not
    ([4, 4, 3, 1, 4, 2], [0, 0, 0, 6, 0, 5]),
])
def test_backend_matches_reference(extend_lens: list[int], prefix_lens: list[int],
                                   in_place_decode: bool, how: LayerAttention) -> None:
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(1, 128, NUM_KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    req_to_token = ReqToTokenPool(6, 32, torch.device("cpu"))
    slots = (torch.randperm(128, generator=gen) + 1).split(16)
    rows = [5, 2, 0, 3, 1, 4][:len(extend_lens)]
    full_k, full_v, new_k, new_v, locs = [], [], [], [], []
    for row, request_slots, n, prefix_len in zip(rows, slots, extend_lens, prefix_lens):
        seq_slots = request_slots[:prefix_len + n]
        req_to_token.table[row, :prefix_len + n] = seq_slots
        k = torch.randn(prefix_len + n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(prefix_len + n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        pool.write(0, seq_slots[:prefix_len], k[:prefix_len], v[:prefix_len])
        full_k.append(k)
        full_v.append(v)
        new_k.append(k[prefix_len:])
        new_v.append(v[prefix_len:])
        locs.append(seq_slots[prefix_len:])
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)
    batch = ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, extend_lens)]),
        out_cache_loc=torch.cat(locs), req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor([p + n for p, n in zip(prefix_lens, extend_lens)]),
        extend_lens=extend_lens)

    backend = TorchNativeBackend(pool, req_to_token, in_place_decode)
    backend.prepare(batch)
    out = backend.forward(0, q, torch.cat(new_k), torch.cat(new_v), how)

    expected = torch.cat([
        _reference(q_part, k, v, prefix_len, how)
        for q_part, k, v, prefix_len in zip(q.split(extend_lens), full_k, full_v, prefix_lens)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.k[0][batch.out_cache_loc], torch.cat(new_k))


def test_in_place_decode_runs_on_this_host() -> None:
    """The CPU path the engine takes by default (`shoal.kernels.prepare` asks `usable`): a host
    where it cannot run would silently fall back to SDPA, so the CI host proves it runs."""
    assert decode_attention.usable()


def test_in_place_decode_needs_cpu_float32_pools() -> None:
    pool = KVPool(1, 8, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cpu"))
    req_to_token = ReqToTokenPool(2, 8, torch.device("cpu"))
    assert not TorchNativeBackend(pool, req_to_token, in_place_decode=False).in_place_decode
    with pytest.raises(ValueError, match="CPU float32"):
        TorchNativeBackend(pool, req_to_token, in_place_decode=True)
