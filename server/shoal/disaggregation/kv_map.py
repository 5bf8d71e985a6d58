"""Which prefill rank's KV goes to which decode rank, when the two servers split the model
differently (their own --tp and --pp). Pure.

A rank holds the KV of its pipeline stage's layers (`pp_layer_range`) and of its tensor-parallel
shard's KV heads (`head_shard`: a contiguous block, or one KV head replicated on several ranks
when the model has fewer KV heads than ranks). Every decode rank needs each (layer, KV head) it
holds from exactly one prefill rank that holds it: for each prefill stage its layers overlap, the
heads it needs come from the prefill ranks holding them; a head held by several prefill ranks
(replicated) comes from the one at the decode rank's TP position modulo the holders, so the
load spreads and equal layouts map rank r to rank r. Between one prefill rank and one decode
rank this is at most one block of layers × heads (a `Piece`).
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.disaggregation.messages import KVSlice, ServerLayout
from shoal.models.layers import head_shard
from shoal.models.parallel import ParallelGroup, pp_layer_range


@dataclass(frozen=True)
class Piece:
    """Prefill rank `src` sends decode rank `dst` the KV of `kv` (whole-model numbering)."""

    src: int
    dst: int
    kv: KVSlice


def rank_slice(layout: ServerLayout, rank: int) -> KVSlice:
    """The layers and KV heads global rank `rank` of a server with this layout holds; a
    ValueError when the layout cannot split the model."""
    pp_rank, tp_rank = divmod(rank, layout.tp)
    layer_start, layer_end = pp_layer_range(layout.num_layers, pp_rank, layout.pp)
    heads = head_shard(layout.num_heads, layout.num_kv_heads,
                       ParallelGroup(rank=tp_rank, size=layout.tp))
    return KVSlice(layer_start, layer_end, heads.kv_start, heads.kv_start + heads.num_kv_heads)


def transfer_plan(prefill: ServerLayout, decode: ServerLayout) -> list[Piece]:
    """Every piece of KV that moves, by decode rank, then prefill rank. A ValueError when
    either layout cannot split the model (the two must serve the same model: the caller checks
    that first)."""
    prefill_slices = [rank_slice(prefill, r) for r in range(prefill.tp * prefill.pp)]
    pieces = []
    for dst in range(decode.tp * decode.pp):
        want = rank_slice(decode, dst)
        dst_tp_rank = dst % decode.tp
        by_src: dict[int, list[int]] = {}  # prefill rank -> the heads it sends, ascending
        for stage in range(prefill.pp):
            stage_slices = prefill_slices[stage * prefill.tp:(stage + 1) * prefill.tp]
            if not _overlap(stage_slices[0], want):
                continue
            for head in range(want.head_start, want.head_end):
                holders = [stage * prefill.tp + t for t, held in enumerate(stage_slices)
                           if held.head_start <= head < held.head_end]
                by_src.setdefault(holders[dst_tp_rank % len(holders)], []).append(head)
        for src, heads in sorted(by_src.items()):
            assert heads == list(range(heads[0], heads[-1] + 1)), "a piece's heads are a block"
            held = prefill_slices[src]
            pieces.append(Piece(src, dst, KVSlice(
                max(held.layer_start, want.layer_start), min(held.layer_end, want.layer_end),
                heads[0], heads[-1] + 1)))
    return pieces


def _overlap(a: KVSlice, b: KVSlice) -> bool:
    return max(a.layer_start, b.layer_start) < min(a.layer_end, b.layer_end)
