"""Which prefill rank's KV heads and layers go to which decode rank, when the two servers split
the model their own way (`shoal.disaggregation.kv_map`), and what the handshake refuses
(`shoal.disaggregation.layout.incompatibility`)."""

from __future__ import annotations

import itertools

import pytest

from shoal.disaggregation.kv_map import Piece, rank_slice, transfer_plan
from shoal.disaggregation.layout import incompatibility
from shoal.disaggregation.messages import KVSlice, ServerLayout


def layout(tp: int = 1, pp: int = 1, heads: int = 9, kv_heads: int = 3, layers: int = 30,
           model: str = "SmolLM2-135M-Instruct") -> ServerLayout:
    """SmolLM2-135M's shape by default: 9 query heads in 3 GQA groups, 30 layers."""
    return ServerLayout(model=model, fingerprint="f", dtype="float32", num_layers=layers,
                        num_heads=heads, num_kv_heads=kv_heads, tp=tp, pp=pp)


def test_equal_layouts_map_each_rank_to_itself_whole() -> None:
    for tp, pp in ((1, 1), (2, 1), (3, 1), (2, 2)):
        side = layout(tp, pp)
        assert transfer_plan(side, side) == [Piece(r, r, rank_slice(side, r))
                                             for r in range(tp * pp)]


def test_three_kv_heads_split_two_and_one_over_two_ranks() -> None:
    assert [rank_slice(layout(tp=2), r) for r in (0, 1)] == [KVSlice(0, 30, 0, 2),
                                                            KVSlice(0, 30, 2, 3)]
    # prefill tp 2 -> decode tp 1: the decode gathers both ranks' heads
    assert transfer_plan(layout(tp=2), layout(tp=1)) == [Piece(0, 0, KVSlice(0, 30, 0, 2)),
                                                         Piece(1, 0, KVSlice(0, 30, 2, 3))]
    # prefill tp 1 -> decode tp 2: the prefill's heads are split between the decode ranks
    assert transfer_plan(layout(tp=1), layout(tp=2)) == [Piece(0, 0, KVSlice(0, 30, 0, 2)),
                                                         Piece(0, 1, KVSlice(0, 30, 2, 3))]


def test_a_replicated_kv_head_is_sent_once_per_decode_rank_spread_over_its_holders() -> None:
    one = {"heads": 4, "kv_heads": 1, "layers": 2}
    assert rank_slice(layout(tp=2, **one), 1) == KVSlice(0, 2, 0, 1)  # both ranks hold head 0
    # prefill tp 2 -> decode tp 1: one copy, from prefill rank 0; prefill rank 1 sends nothing
    assert transfer_plan(layout(tp=2, **one), layout(tp=1, **one)) == [
        Piece(0, 0, KVSlice(0, 2, 0, 1))]
    # prefill tp 1 -> decode tp 2: each decode rank gets its own copy of head 0
    assert transfer_plan(layout(tp=1, **one), layout(tp=2, **one)) == [
        Piece(0, 0, KVSlice(0, 2, 0, 1)), Piece(0, 1, KVSlice(0, 2, 0, 1))]
    # prefill tp 2 -> decode tp 4: decode ranks 0..3 take from prefill ranks 0, 1, 0, 1
    assert [p.src for p in transfer_plan(layout(tp=2, **one), layout(tp=4, **one))] == \
        [0, 1, 0, 1]


def test_pipeline_stages_split_and_gather_layers() -> None:
    # prefill pp 2 (layers 15 + 15) -> decode pp 3 (10 + 10 + 10)
    assert transfer_plan(layout(pp=2), layout(pp=3)) == [
        Piece(0, 0, KVSlice(0, 10, 0, 3)), Piece(0, 1, KVSlice(10, 15, 0, 3)),
        Piece(1, 1, KVSlice(15, 20, 0, 3)), Piece(1, 2, KVSlice(20, 30, 0, 3))]


SHAPES = [(9, 3, 30), (4, 1, 5), (8, 2, 4), (8, 8, 3), (6, 2, 7)]
SPLITS = [(tp, pp) for tp, pp in itertools.product((1, 2, 3, 4), (1, 2, 3))]


def _valid(heads: int, kv_heads: int, layers: int, tp: int, pp: int) -> bool:
    try:
        for rank in range(tp * pp):
            rank_slice(layout(tp, pp, heads, kv_heads, layers), rank)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("heads", "kv_heads", "layers"), SHAPES)
def test_every_decode_rank_gets_each_layer_and_head_it_holds_once_from_a_holder(
        heads: int, kv_heads: int, layers: int) -> None:
    valid = [s for s in SPLITS if _valid(heads, kv_heads, layers, *s)]
    assert len(valid) >= 4
    for (ptp, ppp), (dtp, dpp) in itertools.product(valid, valid):
        prefill = layout(ptp, ppp, heads, kv_heads, layers)
        decode = layout(dtp, dpp, heads, kv_heads, layers)
        got: dict[int, list[tuple[int, int]]] = {r: [] for r in range(dtp * dpp)}
        for piece in transfer_plan(prefill, decode):
            held = rank_slice(prefill, piece.src)
            assert held.layer_start <= piece.kv.layer_start < piece.kv.layer_end \
                <= held.layer_end and held.head_start <= piece.kv.head_start \
                < piece.kv.head_end <= held.head_end, (prefill, decode, piece)
            got[piece.dst] += [(layer, head)
                               for layer in range(piece.kv.layer_start, piece.kv.layer_end)
                               for head in range(piece.kv.head_start, piece.kv.head_end)]
        for dst, cells in got.items():
            want = rank_slice(decode, dst)
            assert sorted(cells) == [(layer, head)
                                     for layer in range(want.layer_start, want.layer_end)
                                     for head in range(want.head_start, want.head_end)], \
                (prefill, decode, dst)


def test_the_handshake_takes_any_split_of_the_same_model_and_names_both_layouts_otherwise(
        ) -> None:
    address = "10.0.0.1:8998"
    assert incompatibility(layout(tp=2), layout(tp=1), address) is None
    assert incompatibility(layout(tp=1, pp=2), layout(tp=2), address) is None

    other = incompatibility(layout(tp=2, model="tiny-llama"), layout(tp=1), address)
    assert other is not None
    assert "'tiny-llama'" in other and "'SmolLM2-135M-Instruct'" in other and address in other
    assert "tp=2" in other and "tp=1" in other

    # a layout that cannot split the model (as no server starts with): 2 KV heads on 3 ranks
    unmappable = incompatibility(layout(tp=3, heads=4, kv_heads=2),
                                 layout(tp=1, heads=4, kv_heads=2), address)
    assert unmappable is not None
    assert "tp=3" in unmappable and "tp=1" in unmappable and "cannot be mapped" in unmappable
