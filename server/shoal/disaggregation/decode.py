"""A decode rank's end of its transfers: learn the prefill's layout, tell the prefill where the
KV goes, take the chunks in, and hold the first token until the scheduler commits the request.

    open(room, address)   BOOTSTRAPPING until the prefill at `address` has told its layout
                          (deadline: the timeout); cached per address, re-asked every second
    (layout, compatible)  WAITING: the scheduler may preallocate slots, then `send_dest`
    send_dest             TRANSFERRING (deadline: the timeout, again after each chunk); chunks
                          queue for `write_chunks`
    (KVDone, complete)    SUCCESS, and a KVAck to the prefill
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

import torch
import zmq

from shoal.disaggregation.layout import LocalModel, incompatibility
from shoal.disaggregation.messages import (
    AnyKVMessage,
    FirstToken,
    KVAbort,
    KVAck,
    KVChunk,
    KVDest,
    KVDone,
    KVMessage,
    LayoutQuery,
    Ping,
    Pong,
    PrefillLayout,
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
    k: zmq.Frame
    v: zmq.Frame


@dataclass
class InRoom(Room):
    address: str = ""   # the prefill's bootstrap host:port
    num_tokens: int = 0
    received: int = 0
    chunks: list[Chunk] = field(default_factory=list)
    first: FirstToken | None = None


@dataclass
class PrefillPeer:
    layout: PrefillLayout | None = None
    asked_at: float = 0.0
    last_heard: float = 0.0


def write_chunk(pool: KVPool, slots: torch.Tensor, chunk: Chunk) -> None:
    """Write a chunk's K and V (as `prefill.gather` laid them out) into `slots`."""
    k_first = pool.k[0]
    shape = (len(pool.k), chunk.num_tokens, *k_first.shape[1:])
    with warnings.catch_warnings():  # the frames are read-only; they are only read
        warnings.simplefilter("ignore", UserWarning)
        k = torch.frombuffer(chunk.k.buffer, dtype=k_first.dtype).view(shape)
        v = torch.frombuffer(chunk.v.buffer, dtype=k_first.dtype).view(shape)
    slots = slots.to(k_first.device)
    for layer in range(len(pool.k)):
        pool.write(layer, slots, k[layer].to(k_first.device), v[layer].to(k_first.device))


class DecodeTransfer:
    def __init__(self, transport: Transport, rank: int, session: str, local: LocalModel,
                 pool: KVPool, timeout_s: float, counters: TransferCounters,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.transport = transport
        self.rank = rank
        self.session = session
        self.local = local
        self.pool = pool
        self.timeout_s = timeout_s
        self.counters = counters
        self.clock = clock
        self.changed = threading.Event()
        self._lock = threading.Lock()
        self._rooms: dict[int, InRoom] = {}
        self._peers: dict[str, PrefillPeer] = {}
        k = pool.k[0]
        self._chunk_bytes_per_token = 2 * len(pool.k) * k[0].numel() * k.element_size()

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
        """This rank holds slots for the room's prompt: ask the prefill rank for its KV."""
        with self._lock:
            state = self._rooms[room]
            peer = self._peers.get(state.address)
            if state.state != KVPoll.WAITING or peer is None or peer.layout is None:
                state.fail("the prefill server went away before the KV was asked for")
                return
            state.advance(KVPoll.TRANSFERRING, self.clock() + self.timeout_s)
            endpoint = peer.layout.endpoints[self.rank]
        dest = KVDest(room=room, session=self.session, endpoint=self.transport.inbox_endpoint,
                      num_tokens=state.num_tokens)
        self.transport.post(lambda t: t.send(endpoint, dest))

    def write_chunks(self, room: int, slots: torch.Tensor) -> None:
        """Write what arrived for the room into its slots (the prompt's, position by position)."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.state == KVPoll.FAILED:
                return
            chunks, state.chunks = state.chunks, []
        for chunk in chunks:
            write_chunk(self.pool, slots[chunk.start:chunk.start + chunk.num_tokens], chunk)
            self.counters.received(chunk.num_tokens,
                                   chunk.num_tokens * self._chunk_bytes_per_token)

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
            endpoint = (peer.layout.endpoints[self.rank]
                        if peer is not None and peer.layout is not None else None)
        if endpoint is not None:
            message = KVAbort(room=room, reason=reason)
            self.transport.post(lambda t: t.send(endpoint, message))

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
        transport.ask(address, LayoutQuery(session=self.session))

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
        problem = incompatibility(layout, self.local, address)
        rooms = [(r, s) for r, s in self._rooms.items() if s.address == address]
        if problem is not None:
            logger.error("refusing the prefill server at %s: %s", address, problem)
            del self._peers[address]
            self.transport.drop_client(address)
            endpoint = layout.endpoints[self.rank] if self.rank < len(layout.endpoints) else None
            for room, state in rooms:
                if state.fail(problem) and endpoint is not None:
                    self.transport.send(endpoint, KVAbort(room=room, reason=problem))
            return
        peer.layout = layout
        for _, state in rooms:
            state.advance(KVPoll.WAITING)

    def on_message(self, message: AnyKVMessage, frames: list[zmq.Frame]) -> None:
        reply: tuple[str, KVMessage] | None = None
        with self._lock:
            if isinstance(message, KVChunk | KVDone):
                state = self._rooms.get(message.room)
                if (message.session != self.session or state is None
                        or state.state != KVPoll.TRANSFERRING):
                    logger.debug("dropping %s for room %d: not transferring here",
                                 type(message).__name__, message.room)
                    return
                reply = self._take(message, frames, state)
            elif isinstance(message, KVAbort):
                state = self._rooms.get(message.room)
                if state is not None:
                    state.fail(f"the prefill server ended the transfer: {message.reason}")
            else:
                logger.warning("decode inbox: unexpected %s", type(message).__name__)
                return
        if reply is not None:
            self.transport.send(*reply)
        self.changed.set()

    def _take(self, message: KVChunk | KVDone, frames: list[zmq.Frame],
              state: InRoom) -> tuple[str, KVMessage] | None:
        if isinstance(message, KVChunk):
            expected = message.num_tokens * self._chunk_bytes_per_token // 2
            end = message.start + message.num_tokens
            if len(frames) != 2 or any(len(f.buffer) != expected for f in frames) \
                    or end > state.num_tokens:
                state.fail(f"a KV chunk of tokens [{message.start}, {end}) does not fit this "
                           f"server's KV layout")
                return None
            state.chunks.append(Chunk(message.start, message.num_tokens, frames[0], frames[1]))
            state.received += message.num_tokens
            state.deadline = self.clock() + self.timeout_s  # a long prompt is still moving
            return None
        peer = self._peers.get(state.address)
        endpoint = peer.layout.endpoints[self.rank] if peer and peer.layout else None
        complete = message.num_tokens == state.num_tokens == state.received
        if complete:
            state.first = message.first
            state.advance(KVPoll.SUCCESS)
        else:
            state.fail(f"the prefill sent {state.received} of {state.num_tokens} prompt tokens")
        if endpoint is None:
            return None
        return endpoint, KVAck(room=message.room, ok=complete, message=state.reason)

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
