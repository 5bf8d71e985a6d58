"""Attention over the paged KV pool: the torch implementation of `AttentionBackend`
(`shoal.models.attention_backend` states the contract), with decode rows on CPU float32 attending
in place (`shoal.kernels.decode_attention`) where `shoal.kernels.prepare` chose it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shoal.engine.kv_pool import KVPool, ReqToTokenPool
from shoal.kernels import decode_attention
from shoal.kernels.interface import PagedDecode
from shoal.models.attention_backend import FULL_ATTENTION, AttentionBackend, LayerAttention
from shoal.models.forward_batch import ForwardBatch


@dataclass(frozen=True)
class _Keys:
    """The keys some requests attend to, padded to a common length, for one SDPA call.

    slots: [requests, max_seq_len] KV slots; padding points at slot 0.
    mask:  [requests, 1, queries, max_seq_len] additive mask (0 where a query may attend,
           -inf elsewhere), or None when every query sees every key.
    """

    slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass(frozen=True)
class _DecodeRows:
    """The decode rows of a forward: their rows of the request -> token table and sequence
    lengths (read in place; `lens` on the host), or their keys gathered for SDPA."""

    rows: torch.Tensor
    seq_lens: torch.Tensor
    lens: list[int]
    keys: _Keys | None


@dataclass(frozen=True)
class _ExtendRow:
    start: int  # the row's new tokens are [start, end) of the batch's token dimension
    end: int
    row: int  # its row of the request -> token table
    seq_len: int
    keys: _Keys


@dataclass(frozen=True)
class _FreshRows:
    """`count` adjacent extend rows of whole prompts of `length` tokens each, nothing cached
    before them: tokens [start, end) of the batch. Each prompt's queries attend causally to its
    own new K/V, read from the forward's k / v (the values just written to the pool), all in one
    SDPA call rather than one gather and call a row."""

    start: int
    count: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.count * self.length


class TorchNativeBackend(AttentionBackend):
    """Decode rows together in one call: in place where `in_place_decode` (CPU float32 pools;
    `shoal.kernels.prepare` says whether the kernel runs here), else
    `scaled_dot_product_attention` over their gathered K/V;
    adjacent whole prompts of one length (nothing cached before them) in one SDPA call over the
    forward's own K/V; every other extend row (a chunk after a prefix) in its own call.

    A layer whose `LayerAttention` masks more than causality (a sliding window, soft-capped
    scores) gathers its decode rows' keys too, masked to its window, built once per forward and
    window; soft-capped scores are computed without SDPA, which has no cap."""

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool, in_place_decode: bool
                 ) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        cpu_float32 = kv_pool.k[0].device.type == "cpu" and kv_pool.k[0].dtype == torch.float32
        if in_place_decode and not cpu_float32:
            raise ValueError("in-place decode attention needs CPU float32 KV pools")
        self.in_place_decode = in_place_decode
        self._out_cache_loc = torch.empty(0, dtype=torch.int64)
        self._decode: _DecodeRows | None = None
        self._decode_tokens: torch.Tensor | None = None  # None: every token is a decode row
        self._extends: list[_ExtendRow] = []
        self._fresh: list[_FreshRows] = []
        # window -> (decode rows' keys or None, extend rows' keys): built on a layer's first ask
        self._windowed: dict[int | None, tuple[_Keys | None, list[_Keys]]] = {}

    def prepare(self, batch: ForwardBatch) -> None:
        self._out_cache_loc = batch.out_cache_loc
        self._windowed = {}
        if batch.is_decode:
            self._decode = self._decode_keys(batch.req_pool_indices, batch.seq_lens,
                                             batch.seq_lens_list)
            self._decode_tokens, self._extends, self._fresh = None, [], []
            return
        rows = batch.req_pool_indices.tolist()
        starts = [0]
        for n in batch.extend_lens[:-1]:
            starts.append(starts[-1] + n)
        self._extends, self._fresh = [], []
        for r, (n, seq_len) in enumerate(zip(batch.extend_lens, batch.seq_lens_list)):
            if n == 1:
                continue
            if n < seq_len:
                self._extends.append(_ExtendRow(starts[r], starts[r] + n, rows[r], seq_len,
                                                self._extend_keys(rows[r], n, seq_len)))
            elif self._fresh and self._fresh[-1].length == n and self._fresh[-1].end == starts[r]:
                last = self._fresh[-1]
                self._fresh[-1] = _FreshRows(last.start, last.count + 1, n)
            else:
                self._fresh.append(_FreshRows(starts[r], 1, n))
        decode = [r for r, n in enumerate(batch.extend_lens) if n == 1]
        self._decode = self._decode_tokens = None
        if decode:
            device = batch.input_ids.device
            picked = torch.tensor(decode, dtype=torch.int64, device=device)
            self._decode = self._decode_keys(batch.req_pool_indices[picked], batch.seq_lens[picked],
                                             [batch.seq_lens_list[r] for r in decode])
            self._decode_tokens = torch.tensor([starts[r] for r in decode], dtype=torch.int64,
                                               device=device)

    def paged_decode(self) -> PagedDecode | None:
        decode = self._decode
        if not self.in_place_decode or decode is None or self._decode_tokens is not None:
            return None
        return PagedDecode(self.kv_pool.k, self.kv_pool.v, self.req_to_token.table, decode.rows,
                           decode.seq_lens, self._out_cache_loc)

    def _decode_keys(self, rows: torch.Tensor, seq_lens: torch.Tensor, lens: list[int]
                     ) -> _DecodeRows:
        """Decode rows; `lens` is `seq_lens` on the host (no device sync)."""
        if self.in_place_decode:
            return _DecodeRows(rows, seq_lens, lens, None)
        max_len = max(lens)
        if min(lens) == max_len:
            return _DecodeRows(rows, seq_lens, lens,
                               _Keys(self.req_to_token.table[rows, :max_len], None))
        return _DecodeRows(rows, seq_lens, lens,
                           self._masked_keys(rows, (seq_lens - 1)[:, None], max_len, None))

    def _extend_keys(self, row: int, extend_len: int, seq_len: int,
                     window: int | None = None) -> _Keys:
        """The keys of an extend row after a prefix (cached, or its prompt's earlier chunks)."""
        table = self.req_to_token.table
        queries = torch.arange(seq_len - extend_len, seq_len, device=table.device)
        rows = torch.tensor([row], dtype=torch.int64, device=table.device)
        return self._masked_keys(rows, queries[None], seq_len, window)

    def _masked_keys(self, rows: torch.Tensor, queries: torch.Tensor, length: int,
                     window: int | None) -> _Keys:
        """The keys of the table's `rows` (each row's positions [0, length)) for the query
        positions `queries` [rows, queries]: each sees the keys at or before it, and with a
        `window` only its last `window`, which are all that is gathered (from each row's
        earliest query's window on). Slots no query of a row sees point at slot 0."""
        table = self.req_to_token.table
        first = torch.zeros(len(rows), dtype=torch.int64, device=table.device)
        width = length
        if window is not None:
            first = (queries[:, 0] - window + 1).clamp(min=0)
            width = min(length, int((queries[:, -1] - queries[:, 0]).max()) + window)
        keys = first[:, None] + torch.arange(width, device=table.device)
        visible = _visible(keys, queries, window)
        slots = table[rows[:, None], keys.clamp(max=table.shape[1] - 1)]
        slots = slots.masked_fill(~visible.any(dim=1), 0)
        return _Keys(slots, _additive(visible[:, None], self.kv_pool.k[0].dtype))

    def _window_keys(self, window: int | None) -> tuple[_Keys | None, list[_Keys]]:
        """The decode rows' and the extend rows' keys masked to `window`, once per forward."""
        if window not in self._windowed:
            decode = self._decode
            decode_keys = None if decode is None else self._masked_keys(
                decode.rows, (decode.seq_lens - 1)[:, None], max(decode.lens), window)
            extends = [self._extend_keys(row.row, row.end - row.start, row.seq_len, window)
                       for row in self._extends]
            self._windowed[window] = (decode_keys, extends)
        return self._windowed[window]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                how: LayerAttention = FULL_ATTENTION) -> torch.Tensor:
        self.kv_pool.write(layer, self._out_cache_loc, k, v)
        k_cache, v_cache = self.kv_pool.k[layer], self.kv_pool.v[layer]
        if how.masks_beyond_causal:
            decode_keys, extend_keys = self._window_keys(how.sliding_window)
        else:
            decode_keys = None if self._decode is None else self._decode.keys
            extend_keys = [row.keys for row in self._extends]
        if self._decode is not None and self._decode_tokens is None:
            return self._attend_decode(q, k_cache, v_cache, decode_keys, how)
        out = torch.empty_like(q)
        if self._decode is not None:
            tokens = self._decode_tokens
            assert tokens is not None
            out[tokens] = self._attend_decode(q[tokens], k_cache, v_cache, decode_keys, how)
        for row, keys in zip(self._extends, extend_keys):
            out[row.start:row.end] = _attend(keys, q[None, row.start:row.end],
                                             k_cache, v_cache, how)[0]
        for fresh in self._fresh:
            tokens = slice(fresh.start, fresh.end)
            out[tokens] = _attend_fresh(fresh, q[tokens], k[tokens], v[tokens], how)
        return out

    def _attend_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       keys: _Keys | None, how: LayerAttention) -> torch.Tensor:
        """q [decode rows, heads, dim] -> their attention output; `keys` None: in place."""
        decode = self._decode
        assert decode is not None
        if keys is None:
            if how.scale is not None:  # the kernel scales by dim ** -0.5
                q = q * (how.scale * q.shape[-1] ** 0.5)
            return decode_attention.attend(q, k_cache, v_cache, self.req_to_token.table,
                                           decode.rows, decode.seq_lens)
        return _attend(keys, q[:, None], k_cache, v_cache, how)[:, 0]


def _visible(keys: torch.Tensor, queries: torch.Tensor, window: int | None) -> torch.Tensor:
    """[rows, queries, keys]: whether the query at each position of `queries` [rows, queries]
    sees the key at each position of `keys` [rows, keys]: causally, and within `window`."""
    keys, queries = keys[:, None, :], queries[:, :, None]
    visible = keys <= queries
    return visible if window is None else visible & (keys > queries - window)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          how: LayerAttention, is_causal: bool = False) -> torch.Tensor:
    """Attention of q [batch, heads, queries, dim] over k / v [batch, kv_heads, keys, dim] (GQA:
    query head h reads KV head h // (heads // kv_heads)) under the additive `mask`."""
    if how.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              scale=how.scale, enable_gqa=True)
    assert not is_causal, "soft-capped attention takes its causal mask explicitly"
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if how.scale is None else how.scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / how.softcap) * how.softcap
    if mask is not None:
        scores = scores + mask
    return torch.matmul(scores.softmax(dim=-1), v)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the additive float mask SDPA adds to the scores (built once
    per forward rather than converted in every layer's SDPA call)."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))


def _attend_fresh(fresh: _FreshRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  how: LayerAttention) -> torch.Tensor:
    """q [tokens, heads, dim] and the same tokens' k / v [tokens, kv_heads, dim] of `fresh`'s
    prompts -> attention output like q."""
    def by_prompt(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(fresh.count, fresh.length, *x.shape[1:]).transpose(1, 2)

    mask = None
    if how.masks_beyond_causal:
        positions = torch.arange(fresh.length, device=q.device)
        mask = _additive(_visible(positions[None], positions[None], how.sliding_window),
                         q.dtype)
    out = _sdpa(by_prompt(q), by_prompt(k), by_prompt(v), mask, how, is_causal=mask is None)
    return out.transpose(1, 2).reshape(q.shape)


def _attend(keys: _Keys, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            how: LayerAttention) -> torch.Tensor:
    """q [requests, queries, heads, dim] -> attention output of the same shape."""
    flat = keys.slots.reshape(-1)
    shape = (*keys.slots.shape, *k_cache.shape[1:])
    k = k_cache.index_select(0, flat).view(shape).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(shape).transpose(1, 2)
    return _sdpa(q.transpose(1, 2), k, v, keys.mask, how).transpose(1, 2)
