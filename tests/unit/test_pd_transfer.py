"""The KV transfer layer on its own: a prefill rank and a decode rank in one process, over real
TCP sockets on 127.0.0.1, with random KV pools and no scheduler."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from shoal.disaggregation import decode, prefill
from shoal.disaggregation.decode import DecodeTransfer
from shoal.disaggregation.layout import LocalModel, layout_of
from shoal.disaggregation.messages import FirstToken
from shoal.disaggregation.prefill import PrefillTransfer, gather
from shoal.disaggregation.ranks import KVPoll
from shoal.disaggregation.rooms import TransferCounters
from shoal.disaggregation.transport import Transport
from shoal.engine.kv_pool import KVPool
from shoal.ports import free_port
from tests.support.wait import wait_until

LAYERS, HEADS, HEAD_DIM, SLOTS = 3, 2, 4, 64
MODEL = LocalModel(model="m", fingerprint="f1", dtype="float32", tp=1, pp=1)


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


def make_prefill(model: LocalModel = MODEL, pool: KVPool | None = None,
                 timeout_s: float = 30.0) -> tuple[PrefillTransfer, str, Transport, KVPool]:
    port = free_port()
    transport = Transport(_inbox(), f"tcp://127.0.0.1:{port}")
    layout = layout_of(model, uuid.uuid4().hex, [transport.inbox_endpoint])
    side = PrefillTransfer(transport, layout, timeout_s, TransferCounters(export=False))
    transport.start(side)
    return side, f"127.0.0.1:{port}", transport, pool or _pool(seed=1)


def make_decode(model: LocalModel = MODEL, pool: KVPool | None = None,
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
    model = LocalModel("m", "f1", "bfloat16", 1, 1)
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
    p, address, pt, _ = make_prefill(LocalModel("big-model", "f1", "float32", 1, 1))
    d, dt, _ = make_decode(LocalModel("small-model", "f2", "float32", 1, 1))
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
    wait_until(lambda: pair.decode._rooms[6].received == 4, 5, "the chunk arrives")
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
