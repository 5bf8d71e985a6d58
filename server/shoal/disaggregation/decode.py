"""A decode rank's end of its transfers: learn the prefill's layout, tell the prefill's ranks
where the KV goes, take the chunks in, and hold the first token until the scheduler commits the
request.

    open(room, address)   BOOTSTRAPPING until the prefill at `address` has told its layout
                          (deadline: the timeout); cached per address, re-asked every second
    (layout, compatible)  WAITING: the scheduler may preallocate slots, then `send_dest`
    send_dest             a KVDest to every prefill rank, naming the slice of its KV this rank
                          takes from it (`kv_map.transfer_plan`; maybe none); TRANSFERRING
                          (deadline: the timeout, again after each chunk); chunks queue for
                          `write_chunks`
    (KVDone from every prefill rank, each having sent all its tokens; the first token from
     the prefill's sampling rank)
                          SUCCESS, and a KVAck to every prefill rank
    (an incompatible layout, KVAbort, the prefill's heartbeat lost or its session changed,
     a deadline)          FAILED

The scheduler thread writes the chunks into the KV pool (`write_chunks`), so a room it aborted
never receives another byte: after `abort`, its chunks are dropped. It polls before it takes:
every chunk of a room that polled SUCCESS is already queued.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import zmq

from shoal.disaggregation.kv_map import rank_slice, transfer_plan
from shoal.disaggregation.layout import incompatibility
from shoal.disaggregation.messages import (
    AnyKVMessage,
    FirstToken,
    KVAbort,
    KVAck,
    KVChunk,
    KVDest,
    KVDone,
    KVMessage,
    KVSlice,
    LayoutQuery,
    Ping,
    Pong,
    PrefillLayout,
    ServerLayout,
)
from shoal.disaggregation.ranks import KVPoll
from shoal.disaggregation.rooms import Room, TransferCounters
from shoal.disaggregation.transport import Transport
from shoal.engine.kv_pool import KVPool

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
LOST_AFTER_S = 5.0   # no Pong this long: the prefill server is gone
QUERY_RETRY_S = 1.0  # an unanswered layout query is sent again


@dataclass
class Chunk:
    start: int
    num_tokens: int
    source: int   # the prefill rank it came from
    k: zmq.Frame
    v: zmq.Frame


@dataclass
class InRoom(Room):
    address: str = ""   # the prefill's bootstrap host:port
    num_tokens: int = 0
    received: dict[int, int] = field(default_factory=dict)  # prefill rank -> tokens
    done: set[int] = field(default_factory=set)             # prefill ranks that sent KVDone
    chunks: list[Chunk] = field(default_factory=list)
    first: FirstToken | None = None


@dataclass
class PrefillPeer:
    layout: PrefillLayout | None = None
    sources: dict[int, KVSlice] = field(default_factory=dict)  # what each prefill rank sends
    asked_at: float = 0.0
    last_heard: float = 0.0


def slice_bytes_per_token(kv: KVSlice, head_dim: int, element_size: int) -> int:
    """One token's K (or V) of a slice, in bytes."""
    return ((kv.layer_end - kv.layer_start) * (kv.head_end - kv.head_start) * head_dim
            * element_size)


def write_chunk(pool: KVPool, held: KVSlice, kv: KVSlice, slots: torch.Tensor,
                chunk: Chunk) -> None:
    """Write a chunk's K and V, of the slice `kv` of the model ([layers, tokens, kv_heads,
    head_dim], as `prefill.send_chunk` cut them) into `slots` of this rank's pool, which holds
    `held`."""
    k_first = pool.k[0]
    shape = (kv.layer_end - kv.layer_start, chunk.num_tokens, kv.head_end - kv.head_start,
             k_first.shape[2])
    with warnings.catch_warnings():  # the frames are read-only; they are only read
        warnings.simplefilter("ignore", UserWarning)
        k = torch.frombuffer(chunk.k.buffer, dtype=k_first.dtype).view(shape)
        v = torch.frombuffer(chunk.v.buffer, dtype=k_first.dtype).view(shape)
    slots = slots.to(k_first.device)
    heads = slice(kv.head_start - held.head_start, kv.head_end - held.head_start)
    for i, layer in enumerate(range(kv.layer_start - held.layer_start,
                                    kv.layer_end - held.layer_start)):
        pool.k[layer][:, heads].index_copy_(0, slots, k[i].to(k_first.device))
        pool.v[layer][:, heads].index_copy_(0, slots, v[i].to(k_first.device))


class DecodeTransfer:
    def __init__(self, transport: Transport, rank: int, session: str, local: ServerLayout,
                 pool: KVPool, timeout_s: float, counters: TransferCounters,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`rank`: this rank's global rank in a server with the layout `local`."""
        self.transport = transport
        self.rank = rank
        self.session = session
        self.local = local
        self.held = rank_slice(local, rank)
        self.pool = pool
        self.timeout_s = timeout_s
        self.counters = counters
        self.clock = clock
        self.changed = threading.Event()
        self._lock = threading.Lock()
        self._rooms: dict[int, InRoom] = {}
        self._peers: dict[str, PrefillPeer] = {}
        self._head_dim, self._element_size = pool.k[0].shape[2], pool.k[0].element_size()

    # -- the scheduler thread ---------------------------------------------------------------

    def open(self, room: int, address: str, num_tokens: int) -> None:
        with self._lock:
            state = self._rooms[room] = InRoom(deadline=self.clock() + self.timeout_s,
                                               address=address, num_tokens=num_tokens)
            peer = self._peers.get(address)
            if peer is not None and peer.layout is not None:
                state.advance(KVPoll.WAITING)
                return
        self.transport.post(lambda t: self._ensure_peer(t, address))

    def poll(self, rooms: list[int]) -> list[KVPoll]:
        now = self.clock()
        with self._lock:
            states = []
            for room in rooms:
                state = self._rooms.get(room)
                if state is None:
                    states.append(KVPoll.FAILED)
                    continue
                state.check_deadline(now, self._deadline_reason(state))
                states.append(state.state)
            return states

    def failure(self, room: int) -> str:
        with self._lock:
            state = self._rooms.get(room)
            return state.reason if state is not None and state.reason else "the transfer failed"

    def send_dest(self, room: int) -> None:
        """This rank holds slots for the room's prompt: ask every prefill rank for the KV it
        takes from it."""
        with self._lock:
            state = self._rooms[room]
            peer = self._peers.get(state.address)
            if state.state != KVPoll.WAITING or peer is None or peer.layout is None:
                state.fail("the prefill server went away before the KV was asked for")
                return
            state.advance(KVPoll.TRANSFERRING, self.clock() + self.timeout_s)
            state.received = dict.fromkeys(peer.sources, 0)
            endpoints, sources = peer.layout.endpoints, peer.sources
        for src, endpoint in enumerate(endpoints):
            dest = KVDest(room=room, session=self.session,
                          endpoint=self.transport.inbox_endpoint, num_tokens=state.num_tokens,
                          rank=self.rank, num_ranks=self.local.tp * self.local.pp,
                          want=sources.get(src))
            self.transport.post(partial(Transport.send, endpoint=endpoint, message=dest))

    def write_chunks(self, room: int, slots: torch.Tensor) -> None:
        """Write what arrived for the room into its slots (the prompt's, position by position).
        Tokens are counted once, by the chunks of the first prefill rank this rank takes from."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.state == KVPoll.FAILED:
                return
            chunks, state.chunks = state.chunks, []
            peer = self._peers.get(state.address)
            sources = dict(peer.sources) if peer is not None else {}
        for chunk in chunks:
            kv = sources.get(chunk.source)
            if kv is None:  # the prefill server was lost meanwhile: the room fails
                continue
            write_chunk(self.pool, self.held, kv,
                        slots[chunk.start:chunk.start + chunk.num_tokens], chunk)
            self.counters.received(
                chunk.num_tokens if chunk.source == min(sources) else 0,
                2 * chunk.num_tokens * slice_bytes_per_token(kv, self._head_dim,
                                                             self._element_size))

    def first_token(self, room: int) -> FirstToken:
        with self._lock:
            first = self._rooms[room].first
        assert first is not None, "only a room that polled SUCCESS has its first token"
        return first

    def abort(self, room: int, reason: str) -> None:
        """The room is over here: no more of its KV is written; the prefill is told."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                return
            state.fail(reason)
            state.chunks = []
            peer = self._peers.get(state.address)
            endpoints = peer.layout.endpoints if peer is not None and peer.layout else []
        message = KVAbort(room=room, reason=reason)
        for endpoint in endpoints:
            self.transport.post(partial(Transport.send, endpoint=endpoint, message=message))

    def close(self, room: int) -> None:
        with self._lock:
            state = self._rooms.pop(room, None)
        if state is not None and state.state == KVPoll.FAILED:
            self.counters.failed()

    def wait(self, timeout_s: float) -> None:
        self.changed.wait(timeout_s)
        self.changed.clear()

    def _deadline_reason(self, state: InRoom) -> str:
        if state.state == KVPoll.BOOTSTRAPPING:
            return (f"the prefill's bootstrap server at {state.address} did not answer within "
                    f"{self.timeout_s:g} s (--disaggregation-timeout)")
        return (f"the KV from the prefill server at {state.address} did not arrive within "
                f"{self.timeout_s:g} s (--disaggregation-timeout)")

    # -- the I/O thread ---------------------------------------------------------------------

    def _ensure_peer(self, transport: Transport, address: str) -> None:
        with self._lock:
            if address in self._peers:
                return
            self._peers[address] = PrefillPeer(asked_at=self.clock())
        transport.ask(address, LayoutQuery(session=self.session, server=self.local))

    def on_reply(self, address: str, message: AnyKVMessage) -> None:
        with self._lock:
            peer = self._peers.get(address)
            if peer is None:
                return
            peer.last_heard = self.clock()
            if isinstance(message, PrefillLayout):
                self._take_layout(address, peer, message)
            elif isinstance(message, Pong) and peer.layout is not None \
                    and message.session != peer.layout.session:
                self._lose(address, f"the prefill server at {address} restarted")
        self.changed.set()

    def _take_layout(self, address: str, peer: PrefillPeer, layout: PrefillLayout) -> None:
        problem = incompatibility(layout.server, self.local, address)
        rooms = [(r, s) for r, s in self._rooms.items() if s.address == address]
        if problem is not None:
            logger.error("refusing the prefill server at %s: %s", address, problem)
            del self._peers[address]
            self.transport.drop_client(address)
            for room, state in rooms:
                if state.fail(problem):
                    for endpoint in layout.endpoints:
                        self.transport.send(endpoint, KVAbort(room=room, reason=problem))
            return
        peer.layout = layout
        peer.sources = {piece.src: piece.kv for piece in transfer_plan(layout.server, self.local)
                        if piece.dst == self.rank}
        for _, state in rooms:
            state.advance(KVPoll.WAITING)

    def on_message(self, message: AnyKVMessage, frames: list[zmq.Frame]) -> None:
        replies: list[tuple[str, KVMessage]] = []
        with self._lock:
            if isinstance(message, KVChunk | KVDone):
                state = self._rooms.get(message.room)
                if (message.session != self.session or state is None
                        or state.state != KVPoll.TRANSFERRING):
                    logger.debug("dropping %s for room %d: not transferring here",
                                 type(message).__name__, message.room)
                    return
                replies = self._take(message, frames, state)
            elif isinstance(message, KVAbort):
                state = self._rooms.get(message.room)
                if state is not None:
                    state.fail(f"the prefill server ended the transfer: {message.reason}")
            else:
                logger.warning("decode inbox: unexpected %s", type(message).__name__)
                return
        for reply in replies:
            self.transport.send(*reply)
        self.changed.set()

    def _take(self, message: KVChunk | KVDone, frames: list[zmq.Frame],
              state: InRoom) -> list[tuple[str, KVMessage]]:
        """A chunk is queued; the last prefill rank's KVDone (each rank's chunks come before its
        KVDone) ends the room: a KVAck to every prefill rank."""
        peer = self._peers.get(state.address)
        if peer is None or peer.layout is None:
            return []
        if isinstance(message, KVChunk):
            kv = peer.sources.get(message.source)
            end = message.start + message.num_tokens
            expected = None if kv is None else message.num_tokens * slice_bytes_per_token(
                kv, self._head_dim, self._element_size)
            if len(frames) != 2 or any(len(f.buffer) != expected for f in frames) \
                    or end > state.num_tokens:
                state.fail(f"a KV chunk of tokens [{message.start}, {end}) from prefill rank "
                           f"{message.source} does not fit this server's KV layout")
                return []
            state.chunks.append(Chunk(message.start, message.num_tokens, message.source,
                                      frames[0], frames[1]))
            state.received[message.source] += message.num_tokens
            state.deadline = self.clock() + self.timeout_s  # a long prompt is still moving
            return []
        state.done.add(message.source)
        if message.first is not None:
            state.first = message.first
        got = state.received.get(message.source, state.num_tokens)
        if message.num_tokens != state.num_tokens or got != state.num_tokens:
            state.fail(f"prefill rank {message.source} sent {got} of {state.num_tokens} prompt "
                       f"tokens")
        elif len(state.done) < len(peer.layout.endpoints):
            return []
        elif state.first is None:
            state.fail("the prefill's sampling rank sent no first token")
        else:
            state.advance(KVPoll.SUCCESS)
        ok = state.state == KVPoll.SUCCESS
        return [(endpoint, KVAck(room=message.room, rank=self.rank, ok=ok,
                                 message=state.reason)) for endpoint in peer.layout.endpoints]

    def on_request(self, message: AnyKVMessage) -> KVMessage | None:
        return None  # a decode rank serves no bootstrap requests

    def on_tick(self, now: float) -> None:
        with self._lock:
            waited_for = {state.address for state in self._rooms.values()}
            for address, peer in list(self._peers.items()):
                if peer.layout is None and address not in waited_for:
                    self._lose(address, f"gave up on the prefill server at {address}")
                elif peer.layout is None:
                    if now - peer.asked_at >= QUERY_RETRY_S:
                        peer.asked_at = now
                        self.transport.ask(address, LayoutQuery(session=self.session))
                elif now - peer.last_heard > LOST_AFTER_S:
                    self._lose(address, f"lost the prefill server at {address}: no heartbeat "
                                        f"for {LOST_AFTER_S:g} s")
                    self.changed.set()
                elif now - peer.asked_at >= HEARTBEAT_S:
                    peer.asked_at = now
                    self.transport.ask(address, Ping(session=self.session))

    def _lose(self, address: str, reason: str) -> None:
        """Forget a prefill server and fail its rooms (lock held)."""
        logger.warning("%s", reason)
        self._peers.pop(address, None)
        self.transport.drop_client(address)
        for state in self._rooms.values():
            if state.address == address:
                state.fail(reason)
