"""The KV transfer layer on its own: a prefill server's ranks and a decode server's ranks in one
process, over real TCP sockets on 127.0.0.1, with random KV pools and no scheduler; the two sides
split the model alike or each its own way (tp, pp)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from shoal.disaggregation import decode, prefill
from shoal.disaggregation.decode import DecodeTransfer
from shoal.disaggregation.kv_map import rank_slice, transfer_plan
from shoal.disaggregation.layout import layout_of
from shoal.disaggregation.messages import FirstToken, ServerLayout
from shoal.disaggregation.prefill import PrefillTransfer, gather
from shoal.disaggregation.ranks import KVPoll
from shoal.disaggregation.rooms import TransferCounters
from shoal.disaggregation.transport import Transport
from shoal.engine.kv_pool import KVPool
from shoal.ports import free_port
from tests.support.wait import wait_until

LAYERS, HEADS, HEAD_DIM, SLOTS = 3, 2, 4, 64
QUERY_HEADS = 4


def layout(model: str = "m", fingerprint: str = "f1", dtype: str = "float32", tp: int = 1,
           pp: int = 1, kv_heads: int = HEADS) -> ServerLayout:
    return ServerLayout(model=model, fingerprint=fingerprint, dtype=dtype, num_layers=LAYERS,
                        num_heads=QUERY_HEADS, num_kv_heads=kv_heads, tp=tp, pp=pp)


MODEL = layout()


def _pool(dtype: torch.dtype = torch.float32, seed: int = 0) -> KVPool:
    pool = KVPool(LAYERS, SLOTS, HEADS, HEAD_DIM, dtype, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    for tensor in pool.k + pool.v:
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(dtype))
    return pool


def _inbox() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@dataclass
class Pair:
    prefill: PrefillTransfer
    decode: DecodeTransfer
    address: str
    prefill_pool: KVPool
    decode_pool: KVPool
    transports: list[Transport]

    def close(self) -> None:
        for transport in self.transports:
            transport.close()


def make_prefill(model: ServerLayout = MODEL, pool: KVPool | None = None,
                 timeout_s: float = 30.0) -> tuple[PrefillTransfer, str, Transport, KVPool]:
    port = free_port()
    transport = Transport(_inbox(), f"tcp://127.0.0.1:{port}")
    announced = layout_of(model, uuid.uuid4().hex, [transport.inbox_endpoint])
    side = PrefillTransfer(transport, 0, rank_slice(model, 0), True, announced, timeout_s,
                           TransferCounters(export=False))
    transport.start(side)
    return side, f"127.0.0.1:{port}", transport, pool or _pool(seed=1)


def make_decode(model: ServerLayout = MODEL, pool: KVPool | None = None,
                timeout_s: float = 30.0) -> tuple[DecodeTransfer, Transport, KVPool]:
    transport = Transport(_inbox())
    pool = pool or _pool(seed=2)
    side = DecodeTransfer(transport, 0, uuid.uuid4().hex, model, pool, timeout_s,
                          TransferCounters(export=False))
    transport.start(side)
    return side, transport, pool


@pytest.fixture
def pair() -> Iterator[Pair]:
    p, address, pt, p_pool = make_prefill()
    d, dt, d_pool = make_decode()
    made = Pair(p, d, address, p_pool, d_pool, [pt, dt])
    yield made
    made.close()


def _until(side: PrefillTransfer | DecodeTransfer, room: int, state: KVPoll,
           timeout: float = 10) -> None:
    wait_until(lambda: side.poll([room]) == [state], timeout, f"room {room} reaches {state.name}",
               interval=0.01)


def _transfer(pair: Pair, room: int, src: torch.Tensor, dst: torch.Tensor,
              chunk: int) -> None:
    """Open both ends, move the prompt's KV in chunks, finish with a first token."""
    pair.prefill.open(room)
    pair.decode.open(room, pair.address, len(src))
    _until(pair.decode, room, KVPoll.WAITING)
    pair.decode.send_dest(room)
    _until(pair.prefill, room, KVPoll.WAITING)
    for start in range(0, len(src), chunk):
        k, v = gather(pair.prefill_pool, src[start:start + chunk])
        pair.prefill.send_chunk(room, start, k, v)
    pair.prefill.send_done(room, len(src), FirstToken(token=7, cached_tokens=3,
                                                       generator_state=b"\1\2"))
    _until(pair.decode, room, KVPoll.SUCCESS)
    pair.decode.write_chunks(room, dst)
    _until(pair.prefill, room, KVPoll.SUCCESS)


def test_kv_lands_in_the_decodes_slots_and_the_bytes_add_up(pair: Pair) -> None:
    src = torch.tensor([5, 9, 1, 30, 31, 32, 2])
    dst = torch.tensor([40, 41, 42, 43, 44, 45, 46])
    _transfer(pair, room=12345, src=src, dst=dst, chunk=3)
    for layer in range(LAYERS):
        assert torch.equal(pair.decode_pool.k[layer][dst], pair.prefill_pool.k[layer][src])
        assert torch.equal(pair.decode_pool.v[layer][dst], pair.prefill_pool.v[layer][src])
    per_token = KVPool.bytes_per_token(LAYERS, HEADS, HEAD_DIM, torch.float32)
    sent, received = pair.prefill.counters.as_dict(), pair.decode.counters.as_dict()
    assert sent["kv_bytes_sent"] == received["kv_bytes_received"] == len(src) * per_token
    assert sent["kv_tokens_sent"] == received["kv_tokens_received"] == len(src)
    first = pair.decode.first_token(12345)
    assert (first.token, first.cached_tokens, first.generator_state) == (7, 3, b"\1\2")


def test_bfloat16_round_trips_bit_exactly() -> None:
    model = layout(dtype="bfloat16")
    p, address, pt, p_pool = make_prefill(model, _pool(torch.bfloat16, seed=3))
    d, dt, d_pool = make_decode(model, _pool(torch.bfloat16, seed=4))
    pair = Pair(p, d, address, p_pool, d_pool, [pt, dt])
    try:
        src, dst = torch.arange(1, 11), torch.arange(20, 30)
        _transfer(pair, room=1, src=src, dst=dst, chunk=4)
        for layer in range(LAYERS):
            assert torch.equal(d_pool.k[layer][dst].view(torch.int16),
                               p_pool.k[layer][src].view(torch.int16))
    finally:
        pair.close()


def test_a_decode_may_answer_before_the_prefill_has_the_request(pair: Pair) -> None:
    pair.decode.open(5, pair.address, 2)
    _until(pair.decode, 5, KVPoll.WAITING)
    pair.decode.send_dest(5)
    time.sleep(0.2)  # the KVDest arrives for a room the prefill does not know yet
    pair.prefill.open(5)
    _until(pair.prefill, 5, KVPoll.WAITING)


def test_a_mismatched_model_is_refused_at_the_handshake_naming_both() -> None:
    p, address, pt, _ = make_prefill(layout("big-model"))
    d, dt, _ = make_decode(layout("small-model", "f2"))
    try:
        p.open(9)
        d.open(9, address, 4)
        _until(d, 9, KVPoll.FAILED)
        reason = d.failure(9)
        assert "'big-model'" in reason and "'small-model'" in reason and address in reason
        _until(p, 9, KVPoll.FAILED)  # told through the inbox, not by a timeout
        assert "'small-model'" in p.failure(9)
    finally:
        pt.close()
        dt.close()


def test_an_unreachable_bootstrap_server_fails_the_room_within_the_timeout() -> None:
    d, dt, _ = make_decode(timeout_s=1.0)
    try:
        started = time.monotonic()
        address = f"127.0.0.1:{free_port()}"
        d.open(3, address, 4)
        _until(d, 3, KVPoll.FAILED, timeout=5)
        assert time.monotonic() - started < 3
        assert address in d.failure(3) and "did not answer within 1 s" in d.failure(3)
    finally:
        dt.close()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_abort_on_either_side_fails_the_other_at_once(pair: Pair, side: str) -> None:
    pair.prefill.open(4)
    pair.decode.open(4, pair.address, 3)
    _until(pair.decode, 4, KVPoll.WAITING)
    pair.decode.send_dest(4)
    _until(pair.prefill, 4, KVPoll.WAITING)
    aborting, other = (pair.prefill, pair.decode) if side == "prefill" else (pair.decode,
                                                                            pair.prefill)
    aborting.abort(4, "client went away")
    _until(other, 4, KVPoll.FAILED, timeout=3)
    assert "client went away" in other.failure(4)


def test_chunks_of_an_aborted_room_are_never_written(pair: Pair) -> None:
    pair.prefill.open(6)
    pair.decode.open(6, pair.address, 4)
    _until(pair.decode, 6, KVPoll.WAITING)
    pair.decode.send_dest(6)
    _until(pair.prefill, 6, KVPoll.WAITING)
    k, v = gather(pair.prefill_pool, torch.tensor([1, 2, 3, 4]))
    pair.prefill.send_chunk(6, 0, k, v)
    wait_until(lambda: pair.decode._rooms[6].received == {0: 4}, 5, "the chunk arrives")
    before = [t.clone() for t in pair.decode_pool.k]
    pair.decode.abort(6, "aborted")
    pair.decode.write_chunks(6, torch.tensor([10, 11, 12, 13]))
    assert all(torch.equal(a, b) for a, b in zip(before, pair.decode_pool.k))


def test_a_lost_decode_fails_its_rooms_on_the_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefill, "LOST_AFTER_S", 0.5)
    p, address, pt, _ = make_prefill()
    d, dt, _ = make_decode()
    try:
        p.open(8)
        d.open(8, address, 2)
        _until(d, 8, KVPoll.WAITING)
        d.send_dest(8)
        _until(p, 8, KVPoll.WAITING)
        dt.close()  # the decode server is gone: no more pings
        _until(p, 8, KVPoll.FAILED, timeout=5)
        assert "lost the decode server" in p.failure(8)
    finally:
        pt.close()


def test_a_restarted_prefill_fails_the_decodes_rooms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode, "HEARTBEAT_S", 0.1)
    p, address, pt, _ = make_prefill()
    d, dt, _ = make_decode()
    try:
        d.open(2, address, 2)
        _until(d, 2, KVPoll.WAITING)
        assert p.layout is not None
        p.layout = layout_of(MODEL, "a-new-session", p.layout.endpoints)
        _until(d, 2, KVPoll.FAILED, timeout=5)
        assert "restarted" in d.failure(2)
    finally:
        pt.close()
        dt.close()


@dataclass
class Ranks:
    """One server's ranks in this process: each rank's end of the transfer and its KV pool."""

    sides: list[PrefillTransfer] | list[DecodeTransfer]
    pools: list[KVPool]
    transports: list[Transport]


def _pool_of(model: ServerLayout, rank: int, whole: list[torch.Tensor] | None) -> KVPool:
    """Rank `rank`'s pool: its layers and heads of `whole` (K then V, each layer [slots,
    kv_heads, head_dim]), or zeros."""
    held = rank_slice(model, rank)
    pool = KVPool(held.layer_end - held.layer_start, SLOTS, held.head_end - held.head_start,
                  HEAD_DIM, torch.float32, torch.device("cpu"))
    if whole is not None:
        for i, layer in enumerate(range(held.layer_start, held.layer_end)):
            pool.k[i][:SLOTS].copy_(whole[layer][:, held.head_start:held.head_end])
            pool.v[i][:SLOTS].copy_(whole[LAYERS + layer][:, held.head_start:held.head_end])
    return pool


def prefill_ranks(model: ServerLayout, whole: list[torch.Tensor]) -> tuple[Ranks, str]:
    port = free_port()
    transports = [Transport(_inbox(), f"tcp://127.0.0.1:{port}" if r == 0 else None)
                  for r in range(model.tp * model.pp)]
    announced = layout_of(model, uuid.uuid4().hex, [t.inbox_endpoint for t in transports])
    sampler = (model.pp - 1) * model.tp  # TP 0 of the last stage
    sides = [PrefillTransfer(t, r, rank_slice(model, r), r == sampler,
                             announced if r == 0 else None, 30.0, TransferCounters(export=False))
             for r, t in enumerate(transports)]
    for side, transport in zip(sides, transports):
        transport.start(side)
    return Ranks(sides, [_pool_of(model, r, whole) for r in range(len(sides))],
                 transports), f"127.0.0.1:{port}"


def decode_ranks(model: ServerLayout) -> Ranks:
    transports = [Transport(_inbox()) for _ in range(model.tp * model.pp)]
    pools = [_pool_of(model, r, None) for r in range(len(transports))]
    sides = [DecodeTransfer(t, r, uuid.uuid4().hex, model, pool, 30.0,
                            TransferCounters(export=False))
             for r, (t, pool) in enumerate(zip(transports, pools))]
    for side, transport in zip(sides, transports):
        transport.start(side)
    return Ranks(sides, pools, transports)


@pytest.mark.parametrize(("prefill_split", "decode_split", "kv_heads"), [
    ((2, 1), (1, 1), 2), ((1, 1), (2, 1), 2), ((2, 1), (1, 1), 1), ((1, 1), (2, 1), 1),
    ((1, 2), (2, 1), 2), ((2, 1), (1, 3), 1)])
def test_kv_moves_between_servers_that_split_the_model_differently(
        prefill_split: tuple[int, int], decode_split: tuple[int, int], kv_heads: int) -> None:
    """Every decode rank ends up with its layers and heads of the prefill's KV, whichever
    prefill ranks held them; every rank of both sides reaches SUCCESS."""
    generator = torch.Generator().manual_seed(5)
    whole = [torch.randn(SLOTS, kv_heads, HEAD_DIM, generator=generator)
             for _ in range(2 * LAYERS)]
    p_model = layout(tp=prefill_split[0], pp=prefill_split[1], kv_heads=kv_heads)
    d_model = layout(tp=decode_split[0], pp=decode_split[1], kv_heads=kv_heads)
    prefill_side, address = prefill_ranks(p_model, whole)
    decode_side = decode_ranks(d_model)
    src, dst, room = torch.tensor([5, 9, 1, 30, 31, 32, 2]), torch.arange(40, 47), 77
    try:
        for side in prefill_side.sides:
            side.open(room)
        for side in decode_side.sides:
            side.open(room, address, len(src))
            _until(side, room, KVPoll.WAITING)
            side.send_dest(room)
        sources = {piece.src for piece in transfer_plan(p_model, d_model)}
        for r, (side, pool) in enumerate(zip(prefill_side.sides, prefill_side.pools)):
            _until(side, room, KVPoll.WAITING)
            assert side.sends_kv(room) == (r in sources)  # a replicated head: one rank sends
            for start in range(0, len(src), 3):
                side.send_chunk(room, start, *gather(pool, src[start:start + 3]))
            # only the sampling rank's request state is the real one: the decode takes its
            side.send_done(room, len(src), FirstToken(token=7 if side.samples else 99))
        for r, (side, pool) in enumerate(zip(decode_side.sides, decode_side.pools)):
            _until(side, room, KVPoll.SUCCESS)
            assert side.first_token(room).token == 7
            side.write_chunks(room, dst)
            held = rank_slice(d_model, r)
            for i, layer in enumerate(range(held.layer_start, held.layer_end)):
                heads = slice(held.head_start, held.head_end)
                assert torch.equal(pool.k[i][dst], whole[layer][src][:, heads])
                assert torch.equal(pool.v[i][dst], whole[LAYERS + layer][src][:, heads])
        for side in prefill_side.sides:
            _until(side, room, KVPoll.SUCCESS)
        # what moved: each decode rank's layers x heads, once (a replicated head once per rank)
        cells = sum((h.layer_end - h.layer_start) * (h.head_end - h.head_start)
                    for h in (rank_slice(d_model, r) for r in range(len(decode_side.sides))))
        assert sum(s.counters.bytes_sent for s in prefill_side.sides) == sum(
            s.counters.bytes_received for s in decode_side.sides) == len(src) * 2 * cells * \
            HEAD_DIM * 4
        assert all(s.counters.tokens_received == len(src) for s in decode_side.sides)
    finally:
        for transport in prefill_side.transports + decode_side.transports:
            transport.close()
