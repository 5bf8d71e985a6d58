"""Prefill/decode disaggregation through the real schedulers: a prefill and a decode scheduler in
one process, each on its own thread with its role, joined by the real transfer layer over TCP on
127.0.0.1, compared with one colocated scheduler. The fake model reads its KV cache, so a missing,
shifted or partial transfer changes what it generates."""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from shoal.disaggregation.decode import DecodeTransfer
from shoal.disaggregation.kv_map import rank_slice
from shoal.disaggregation.layout import layout_of
from shoal.disaggregation.messages import ServerLayout
from shoal.disaggregation.prefill import PrefillTransfer
from shoal.disaggregation.ranks import KVPoll
from shoal.disaggregation.rooms import TransferCounters
from shoal.disaggregation.transport import Transport
from shoal.engine.kv_pool import KVPool, ReqToTokenPool, TokenSlotAllocator
from shoal.ipc.messages import (
    AbortReq,
    AnyMessage,
    BootstrapInfo,
    ComponentReady,
    ControlReply,
    GenerateReq,
    LogprobParams,
    ReqTokenOut,
    SamplingParams,
)
from shoal.models.forward_batch import ForwardBatch
from shoal.models.parallel import ParallelGroup
from shoal.ports import free_port
from shoal.scheduler.decode_role import DecodeRole
from shoal.scheduler.memory import ReqMemory
from shoal.scheduler.prefill_role import PrefillRole
from shoal.scheduler.prefix_cache import RadixCache
from shoal.scheduler.roles import Role
from shoal.scheduler.scheduler import Scheduler, SchedulerConfig
from shoal.scheduler.stop import StopChecker
from tests.support.scheduler import EOS, VOCAB, LetterTokenizer
from tests.support.wait import wait_until

LAYERS, HEADS, HEAD_DIM = 2, 2, 2
CONTEXT, MAX_RUNNING = 256, 16
MODEL = ServerLayout(model="kv-model", fingerprint="f", dtype="float32", num_layers=LAYERS,
                     num_heads=HEADS, num_kv_heads=HEADS, tp=1, pp=1)


class KVModel:
    """Writes K/V = f(token, position) at each new token's slot, and predicts the next token from
    the sum of the request's whole KV up to that position (read back through req_to_token)."""

    def __init__(self, pool: KVPool, table: torch.Tensor, gate: threading.Semaphore | None = None
                 ) -> None:
        self.pool, self.table, self.gate = pool, table, gate

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.gate is not None:
            self.gate.acquire()
        values = ((batch.input_ids * 31 + batch.positions * 7) % 97 + 1).float()
        for layer in range(LAYERS):
            shape = (len(values), HEADS, HEAD_DIM)
            self.pool.k[layer][batch.out_cache_loc] = values.view(-1, 1, 1).expand(shape)
            self.pool.v[layer][batch.out_cache_loc] = (values * (layer + 2)).view(-1, 1, 1).expand(
                shape)
        starts = torch.tensor([0, *batch.extend_lens]).cumsum(0).tolist()
        rows = []
        for token in batch.logits_at.tolist():
            entry = next(i for i in range(batch.batch_size) if token < starts[i + 1])
            position = int(batch.positions[token])
            slots = self.table[int(batch.req_pool_indices[entry]), :position + 1]
            total = sum(float(self.pool.k[layer][slots].sum() + self.pool.v[layer][slots].sum())
                        for layer in range(LAYERS))
            rows.append(int(total) % (VOCAB - 1) + 1)
        return 5.0 * torch.nn.functional.one_hot(torch.tensor(rows), VOCAB).float()


class QueueIO:
    """Thread-safe fake IO: requests in through a queue, outputs kept for the test."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[AnyMessage] = queue.SimpleQueue()
        self.outputs: list[ReqTokenOut] = []
        self.lock = threading.Lock()

    def recv(self, blocking: bool) -> list[AnyMessage]:
        messages = []
        try:
            messages.append(self.inbox.get(timeout=0.05 if blocking else 0))
            while True:
                messages.append(self.inbox.get_nowait())
        except queue.Empty:
            return messages

    def send_outputs(self, outputs: list[ReqTokenOut]) -> None:
        with self.lock:
            self.outputs += outputs

    def send_ready(self, ready: ComponentReady) -> None:
        pass

    def send_reply(self, reply: ControlReply) -> None:
        pass

    def tokens(self, rid: str) -> list[int]:
        with self.lock:
            return [t for o in self.outputs if o.rid == rid for t in o.new_ids]

    def finishes(self, rid: str) -> list[ReqTokenOut]:
        with self.lock:
            return [o for o in self.outputs if o.rid == rid and o.finish is not None]

    def last(self, rid: str) -> ReqTokenOut:
        return self.finishes(rid)[-1]


@dataclass
class Server:
    scheduler: Scheduler
    io: QueueIO
    pool: KVPool
    model: KVModel
    transports: list[Transport] = field(default_factory=list)
    thread: threading.Thread | None = None

    def start(self, overlap: bool = False) -> None:
        loop = self.scheduler.run_forever_overlapped if overlap else self.scheduler.run_forever
        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.scheduler.should_stop = True
        if self.thread is not None:
            self.thread.join(timeout=10)
        for transport in self.transports:
            transport.close()

    def idle_and_whole(self) -> bool:
        memory = self.scheduler.memory
        return (self.scheduler.is_idle
                and memory.allocator.num_free + memory.cache.total_size == memory.allocator.size
                and memory.num_free_req_pool_indices == MAX_RUNNING + 1)


def make_server(num_slots: int = 2048, chunk: int = 16, role: str = "null",
                bootstrap_port: int | None = None, address: str = "", timeout_s: float = 30.0,
                gate: threading.Semaphore | None = None) -> Server:
    device = torch.device("cpu")
    allocator = TokenSlotAllocator(num_slots, device)
    table = ReqToTokenPool(MAX_RUNNING + 1, CONTEXT, device)
    memory = ReqMemory(table, allocator, RadixCache(allocator))
    pool = KVPool(LAYERS, num_slots, HEADS, HEAD_DIM, torch.float32, device)
    stop_checker = StopChecker(LetterTokenizer(), {EOS}, CONTEXT)  # type: ignore[arg-type]
    io, model = QueueIO(), KVModel(pool, table.table, gate)
    transports: list[Transport] = []
    made_role: Role | None = None
    counters = TransferCounters(export=False)
    if role == "prefill":
        transport = Transport(f"tcp://127.0.0.1:{free_port()}",
                              f"tcp://127.0.0.1:{bootstrap_port}")
        side = PrefillTransfer(transport, 0, rank_slice(MODEL, 0), True,
                               layout_of(MODEL, uuid.uuid4().hex, [transport.inbox_endpoint]),
                               timeout_s, counters)
        transport.start(side)
        transports.append(transport)
        made_role = PrefillRole(side, pool, memory, ParallelGroup())
    elif role == "decode":
        transport = Transport(f"tcp://127.0.0.1:{free_port()}")
        side_d = DecodeTransfer(transport, 0, uuid.uuid4().hex, MODEL, pool, timeout_s, counters)
        transport.start(side_d)
        transports.append(transport)
        made_role = DecodeRole(side_d, memory, stop_checker, MAX_RUNNING, ParallelGroup())
    scheduler = Scheduler(runner=model, memory=memory, io=io, stop_checker=stop_checker,
                          config=SchedulerConfig(CONTEXT, MAX_RUNNING, chunk), role=made_role)
    return Server(scheduler, io, pool, model, transports)


@dataclass
class Trio:
    prefill: Server
    decode: Server
    address: str
    next_room: int = 1000

    def send(self, req: GenerateReq, to: tuple[str, ...] = ("prefill", "decode")) -> None:
        self.next_room += 1
        host, port = self.address.split(":")
        req.bootstrap = BootstrapInfo(host=host, port=int(port), room=self.next_room)
        for name in to:
            getattr(self, name).io.inbox.put(req)

    def wait_finished(self, rids: list[str], timeout: float = 60) -> None:
        wait_until(lambda: all(self.decode.io.finishes(r) for r in rids), timeout,
                   f"the decode finishes {rids}", interval=0.02)

    def wait_whole(self, timeout: float = 10) -> None:
        wait_until(lambda: self.prefill.idle_and_whole() and self.decode.idle_and_whole(),
                   timeout, "both servers idle with every slot free or cached", interval=0.02)


@pytest.fixture(params=[False, True], ids=["plain-loop", "overlap-loop"])
def trio(request: pytest.FixtureRequest) -> Iterator[Trio]:
    port = free_port()
    prefill = make_server(role="prefill", bootstrap_port=port)
    decode = make_server(role="decode")
    prefill.start(overlap=request.param)
    decode.start(overlap=request.param)
    made = Trio(prefill, decode, f"127.0.0.1:{port}")
    yield made
    prefill.stop()
    decode.stop()


def gen(rid: str, prompt: list[int], max_new: int = 8, **params: object) -> GenerateReq:
    sampling = {"temperature": 0.0, **params}
    logprob = sampling.pop("logprob", None)
    return GenerateReq(rid=rid, input_ids=prompt, stream=True, logprob=logprob,  # type: ignore
                       sampling=SamplingParams(max_new_tokens=max_new, **sampling))  # type: ignore


PREFIX = list(range(3, 43))  # 40 tokens, more than two 16-token chunks
REQUESTS = [
    gen("short", [5, 6, 7]),
    gen("long", [(i * 7) % 45 + 2 for i in range(70)], max_new=12),
    gen("shares-1", PREFIX + [44, 45], max_new=6),
    gen("shares-2", PREFIX + [46, 47, 48], max_new=6),
    gen("one-token", [9, 10, 11, 12], max_new=1),
    gen("seeded", [20, 21, 22, 23, 24], max_new=10, temperature=1.0, seed=1234),
    gen("seeded-long", list(range(2, 40)), max_new=10, temperature=0.9, top_k=5, seed=7),
    gen("penalized", [8, 8, 8, 9], max_new=8, frequency_penalty=1.5, repetition_penalty=1.3),
    gen("logprobs", [30, 31, 32, 33, 34, 35], max_new=5,
        logprob=LogprobParams(top_logprobs_num=2, logprob_start_len=0)),
    gen("stops", [12, 13, 14], max_new=20, stop_token_ids=[25, 26, 27, 28, 29, 30]),
]


def colocated_outputs(requests: list[GenerateReq]) -> dict[str, list[ReqTokenOut]]:
    server = make_server()
    server.start()
    try:
        for req in requests:
            server.io.inbox.put(req)
        wait_until(lambda: all(server.io.finishes(r.rid) for r in requests), 60,
                   "the colocated server finishes", interval=0.02)
    finally:
        server.stop()
    return {r.rid: [o for o in server.io.outputs if o.rid == r.rid] for r in requests}


def test_outputs_equal_a_colocated_servers_token_for_token(trio: Trio) -> None:
    expected = colocated_outputs(REQUESTS)
    for req in REQUESTS:
        trio.send(req)
    trio.wait_finished([r.rid for r in REQUESTS])
    for req in REQUESTS:
        outs = [o for o in trio.decode.io.outputs if o.rid == req.rid]
        want = expected[req.rid]
        assert trio.decode.io.tokens(req.rid) == [t for o in want for t in o.new_ids], req.rid
        last, want_last = outs[-1], want[-1]
        assert last.finish == want_last.finish, req.rid
        assert (last.prompt_tokens, last.completion_tokens) == (want_last.prompt_tokens,
                                                                 want_last.completion_tokens)
        assert outs[0].decode_prefix_ids == want[0].decode_prefix_ids
        if req.logprob is not None:
            assert outs[0].prompt_logprobs == want[0].prompt_logprobs
            got = [lp for o in outs if o.logprobs for lp in o.logprobs.logprobs]
            assert got == [lp for o in want if o.logprobs for lp in o.logprobs.logprobs]
        # the prefill answered with the first token once the decode acknowledged it
        assert trio.prefill.io.tokens(req.rid) == trio.decode.io.tokens(req.rid)[:1]
    # the second prompt sharing PREFIX found it in the prefill's cache; the decode reports it
    assert trio.decode.io.last("shares-2").cached_tokens >= 32
    trio.wait_whole()
    info_p, info_d = trio.prefill.scheduler.role.info(), trio.decode.scheduler.role.info()
    prompt_tokens = sum(len(r.input_ids) for r in REQUESTS)
    assert info_p["kv_tokens_sent"] == info_d["kv_tokens_received"] == prompt_tokens
    per_token = KVPool.bytes_per_token(LAYERS, HEADS, HEAD_DIM, torch.float32)
    assert info_p["kv_bytes_sent"] == info_d["kv_bytes_received"] == prompt_tokens * per_token


@pytest.fixture
def gated() -> Iterator[tuple[Trio, threading.Semaphore]]:
    """A trio whose prefill computes one forward per permit of the semaphore."""
    gate = threading.Semaphore(0)
    port = free_port()
    prefill = make_server(role="prefill", bootstrap_port=port, gate=gate)
    decode = make_server(role="decode")
    prefill.start()
    decode.start()
    made = Trio(prefill, decode, f"127.0.0.1:{port}")
    yield made, gate
    gate.release(1000)
    prefill.stop()
    decode.stop()


LONG = gen("long", [(i * 5) % 45 + 2 for i in range(70)], max_new=6)  # 5 chunks of 16


def _aborted_once(server: Server, rid: str) -> str:
    finishes = server.io.finishes(rid)
    assert len(finishes) == 1 and finishes[0].finish is not None
    assert finishes[0].finish.kind == "abort"
    return finishes[0].finish.message


def test_an_abort_while_waiting_for_the_decode_frees_everything(trio: Trio) -> None:
    trio.send(gen("lonely", [1, 2, 3]), to=("prefill",))
    wait_until(lambda: trio.prefill.scheduler.role.has_work, 5, "the prefill holds it")
    trio.prefill.io.inbox.put(AbortReq(rid="lonely"))
    wait_until(lambda: trio.prefill.io.finishes("lonely"), 5, "the abort is answered")
    _aborted_once(trio.prefill, "lonely")
    trio.wait_whole()


def test_a_decode_abort_reaches_a_prefill_that_gets_the_request_later(trio: Trio) -> None:
    req = gen("late", [4, 5, 6, 7])
    trio.send(req, to=("decode",))
    wait_until(lambda: trio.decode.scheduler.role.info()["num_transferring_reqs"] == 1, 5,
               "the decode preallocates and asks for the KV")
    trio.decode.io.inbox.put(AbortReq(rid="late"))
    wait_until(lambda: trio.decode.io.finishes("late"), 5, "the decode aborts")
    trio.prefill.io.inbox.put(req)  # the same room, arriving after the decode gave up
    wait_until(lambda: trio.prefill.io.finishes("late"), 5, "the prefill learns at once")
    assert "ended the transfer" in _aborted_once(trio.prefill, "late")
    trio.wait_whole()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_abort_during_the_transfer_ends_it_on_both_sides(
        gated: tuple[Trio, threading.Semaphore], side: str) -> None:
    trio, gate = gated
    trio.send(LONG)
    gate.release(2)  # two of the prompt's five chunks
    wait_until(lambda: trio.decode.scheduler.role.info()["kv_tokens_received"] == 32, 10,
               "two chunks arrive")
    getattr(trio, side).io.inbox.put(AbortReq(rid="long"))
    if side == "decode":  # the prefill hears it over the KV channel while its forward waits
        wait_until(lambda: trio.prefill.scheduler.role.transfer.poll([trio.next_room]) == [
            KVPoll.FAILED], 10, "the prefill's channel hears the decode ended the transfer")
    gate.release(1000)  # the prefill's third forward was waiting: the abort comes after it
    wait_until(lambda: trio.decode.io.finishes("long") and trio.prefill.io.finishes("long"),
               10, "both sides end the request")
    assert trio.decode.scheduler.role.info()["kv_tokens_received"] < len(LONG.input_ids)
    other = trio.decode if side == "prefill" else trio.prefill
    assert "ended the transfer" in _aborted_once(other, "long")
    _aborted_once(getattr(trio, side), "long")
    trio.wait_whole()


def test_an_abort_while_decoding_is_an_ordinary_abort() -> None:
    # the decode computes one step per permit: the abort lands while it decodes, never after
    # it has run to max_new (the stand-in model is that fast)
    steps = threading.Semaphore(4)
    port = free_port()
    prefill = make_server(role="prefill", bootstrap_port=port)
    decode = make_server(role="decode", gate=steps)
    prefill.start()
    decode.start()
    trio = Trio(prefill, decode, f"127.0.0.1:{port}")
    try:
        trio.send(gen("chatty", [3, 4, 5], max_new=200, ignore_eos=True))
        wait_until(lambda: len(trio.decode.io.tokens("chatty")) >= 3, 10, "decoding")
        trio.decode.io.inbox.put(AbortReq(rid="chatty"))
        steps.release(1000)
        wait_until(lambda: trio.decode.io.finishes("chatty"), 5, "the abort")
        _aborted_once(trio.decode, "chatty")
        assert trio.prefill.io.last("chatty").finish.kind == "length"  # type: ignore[union-attr]
        trio.wait_whole()
    finally:
        steps.release(1000)
        prefill.stop()
        decode.stop()


def test_a_prefill_that_never_sends_times_out_on_the_decode() -> None:
    port = free_port()
    prefill = make_server(role="prefill", bootstrap_port=port)
    decode = make_server(role="decode", timeout_s=1.0)
    prefill.start()
    decode.start()
    trio = Trio(prefill, decode, f"127.0.0.1:{port}")
    try:
        trio.send(gen("never", [1, 2, 3]), to=("decode",))
        wait_until(lambda: decode.io.finishes("never"), 5, "the decode gives up")
        assert "did not arrive within 1 s" in _aborted_once(decode, "never")
        wait_until(decode.idle_and_whole, 5, "the decode's pool is whole")
    finally:
        prefill.stop()
        decode.stop()


def test_requests_that_do_not_fit_the_decode_wait_their_turn() -> None:
    port = free_port()
    prefill = make_server(role="prefill", bootstrap_port=port)
    decode = make_server(role="decode", num_slots=64)
    prefill.start()
    decode.start()
    trio = Trio(prefill, decode, f"127.0.0.1:{port}")
    try:
        requests = [gen(f"big-{i}", [(i + j) % 40 + 2 for j in range(40)], max_new=4)
                    for i in range(3)]
        expected = colocated_outputs(requests)
        for req in requests:
            trio.send(req)
        trio.wait_finished([r.rid for r in requests])
        for req in requests:
            assert trio.decode.io.tokens(req.rid) == [t for o in expected[req.rid]
                                                      for t in o.new_ids]
        trio.wait_whole()
    finally:
        prefill.stop()
        decode.stop()
