"""A prefill rank's end of its transfers: rooms wait for a decode's destination, then the
scheduler sends their KV chunk by chunk, then the first token, and waits for the ack.

    open(room)        BOOTSTRAPPING until a KVDest names the room (deadline: the timeout)
    (KVDest)          WAITING: the scheduler may compute the prompt
    send_chunk/done   TRANSFERRING once done; SUCCESS on a good KVAck (deadline: the timeout)
    (KVAbort, KVAck not ok, the decode's heartbeat lost, a deadline)   FAILED

A decode may answer before the prefill has the request (the router sends both at once), so a
KVDest or KVAbort for a room not opened yet is kept for a while and applied at `open`.

Rank 0 also serves the bootstrap requests: the layout, and pings (a decode session that stops
pinging is lost: its rooms fail).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

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

LOST_AFTER_S = 5.0   # a decode session silent this long is gone
PEER_IDLE_S = 30.0   # a peer socket unused this long is closed (with what a dead peer left)


@dataclass
class OutRoom(Room):
    dest: KVDest | None = None


@dataclass
class _Early:
    message: KVDest | KVAbort
    at: float


def gather(pool: KVPool, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's K and V of `slots`, each [layers, len(slots), kv_heads, head_dim] on the
    CPU, contiguous: a chunk's two frames."""
    k = torch.stack([layer.index_select(0, slots) for layer in pool.k]).cpu().contiguous()
    v = torch.stack([layer.index_select(0, slots) for layer in pool.v]).cpu().contiguous()
    return k, v


def _frame(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy())


class PrefillTransfer:
    def __init__(self, transport: Transport, layout: PrefillLayout | None, timeout_s: float,
                 counters: TransferCounters, clock: Callable[[], float] = time.monotonic) -> None:
        self.transport = transport
        self.layout = layout  # rank 0: what the bootstrap server answers
        self.timeout_s = timeout_s
        self.counters = counters
        self.clock = clock
        self.changed = threading.Event()
        self._lock = threading.Lock()
        self._rooms: dict[int, OutRoom] = {}
        self._early: dict[int, _Early] = {}
        self._last_seen: dict[str, float] = {}  # decode session -> its last message
        self._peer_used: dict[str, float] = {}

    # -- the scheduler thread ---------------------------------------------------------------

    def open(self, room: int) -> None:
        with self._lock:
            state = self._rooms[room] = OutRoom(deadline=self.clock() + self.timeout_s)
            early = self._early.pop(room, None)
            if early is not None:
                self._apply(room, state, early.message)

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

    def send_chunk(self, room: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Send KV of prompt tokens [start, start + n) (n = k.shape[1]) to the room's decode."""
        dest = self._dest(room)
        if dest is None:
            return
        num_tokens = int(k.shape[1])
        chunk = KVChunk(room=room, session=dest.session, start=start, num_tokens=num_tokens)
        self.counters.sent(num_tokens, k.numel() * k.element_size() * 2)
        frames = (_frame(k), _frame(v))
        self.transport.post(lambda t: self._send(t, dest.endpoint, chunk, frames))

    def send_done(self, room: int, num_tokens: int, first: FirstToken) -> None:
        dest = self._dest(room)
        if dest is None:
            return
        with self._lock:
            self._rooms[room].advance(KVPoll.TRANSFERRING, self.clock() + self.timeout_s)
        done = KVDone(room=room, session=dest.session, num_tokens=num_tokens, first=first)
        self.transport.post(lambda t: self._send(t, dest.endpoint, done))

    def abort(self, room: int, reason: str) -> None:
        """The room is over here: fail it and tell its decode, if one is known."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                return
            state.fail(reason)
            dest = state.dest
        if dest is not None:
            message = KVAbort(room=room, reason=reason)
            self.transport.post(lambda t: self._send(t, dest.endpoint, message))

    def close(self, room: int) -> None:
        with self._lock:
            state = self._rooms.pop(room, None)
        if state is not None and state.state == KVPoll.FAILED:
            self.counters.failed()

    def wait(self, timeout_s: float) -> None:
        """Until a room changes state or `timeout_s` passes."""
        self.changed.wait(timeout_s)
        self.changed.clear()

    def _dest(self, room: int) -> KVDest | None:
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.state == KVPoll.FAILED:
                return None
            return state.dest

    def _deadline_reason(self, state: OutRoom) -> str:
        if state.dest is None:
            return (f"no decode server asked for this request's KV within "
                    f"{self.timeout_s:g} s (--disaggregation-timeout)")
        return (f"the decode server did not acknowledge the KV within {self.timeout_s:g} s "
                f"(--disaggregation-timeout)")

    # -- the I/O thread ---------------------------------------------------------------------

    def _send(self, transport: Transport, endpoint: str, message: KVMessage,
              frames: tuple[memoryview, ...] = ()) -> None:
        self._peer_used[endpoint] = self.clock()
        transport.send(endpoint, message, frames)

    def on_message(self, message: AnyKVMessage, frames: list[zmq.Frame]) -> None:
        if not isinstance(message, KVDest | KVAck | KVAbort):
            logger.warning("prefill inbox: unexpected %s", type(message).__name__)
            return
        with self._lock:
            if isinstance(message, KVDest):
                self._last_seen.setdefault(message.session, self.clock())
            state = self._rooms.get(message.room)
            if state is None:
                if not isinstance(message, KVAck):
                    self._early[message.room] = _Early(message, self.clock())
                return
            self._apply(message.room, state, message)
        self.changed.set()

    def _apply(self, room: int, state: OutRoom, message: KVDest | KVAck | KVAbort) -> None:
        if isinstance(message, KVDest):
            if state.state == KVPoll.BOOTSTRAPPING:
                state.dest = message
                state.advance(KVPoll.WAITING)
        elif isinstance(message, KVAck):
            if message.ok:
                state.advance(KVPoll.SUCCESS)
            else:
                state.fail(f"the decode server refused the KV: {message.message}")
        else:
            state.fail(f"the decode server ended the transfer: {message.reason}")

    def on_request(self, message: AnyKVMessage) -> KVMessage | None:
        assert self.layout is not None, "only rank 0 serves bootstrap requests"
        if isinstance(message, LayoutQuery | Ping):
            with self._lock:
                self._last_seen[message.session] = self.clock()
            return self.layout if isinstance(message, LayoutQuery) \
                else Pong(session=self.layout.session)
        logger.warning("bootstrap server: unexpected %s", type(message).__name__)
        return None

    def on_reply(self, address: str, message: AnyKVMessage) -> None:
        logger.warning("prefill: unexpected reply %s from %s", type(message).__name__, address)

    def on_tick(self, now: float) -> None:
        changed = False
        with self._lock:
            if self.layout is not None:  # rank 0 hears the decodes' pings
                for state in self._rooms.values():
                    dest = state.dest
                    if dest is None or state.state in (KVPoll.FAILED, KVPoll.SUCCESS):
                        continue
                    seen = self._last_seen.get(dest.session, now)
                    if now - seen > LOST_AFTER_S:
                        changed |= state.fail(f"lost the decode server ({dest.endpoint}): no "
                                              f"heartbeat for {LOST_AFTER_S:g} s")
            for room in [r for r, e in self._early.items() if now - e.at > self.timeout_s]:
                del self._early[room]
            idle = [e for e, used in self._peer_used.items() if now - used > PEER_IDLE_S]
        for endpoint in idle:
            del self._peer_used[endpoint]
            self.transport.drop_peer(endpoint)
        if changed:
            self.changed.set()
