"""A prefill rank's end of its transfers: rooms wait for the decode's destinations, then the
scheduler sends their KV chunk by chunk, then the first token, and waits for the acks.

    open(room)        BOOTSTRAPPING until every decode rank's KVDest names the room (deadline:
                      the timeout)
    (KVDest × ranks)  WAITING: the scheduler may compute the prompt
    send_chunk/done   each decode rank gets the slice of this rank's KV its KVDest wanted (maybe
                      none), and KVDone; TRANSFERRING once done; SUCCESS on a good KVAck from
                      every decode rank (deadline: the timeout)
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
from dataclasses import dataclass, field
from functools import partial

import torch
import zmq

from shoal.disaggregation.layout import describe, incompatibility
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
    dests: dict[int, KVDest] = field(default_factory=dict)  # by decode rank
    acked: set[int] = field(default_factory=set)             # decode ranks

    def all_dests(self) -> bool:
        return bool(self.dests) and len(self.dests) == next(iter(self.dests.values())).num_ranks


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


def _cut(kv: torch.Tensor, held: KVSlice, want: KVSlice) -> torch.Tensor:
    """The part of this rank's `kv` ([layers, tokens, kv_heads, head_dim] of `held`) that
    `want` covers, contiguous."""
    return kv[want.layer_start - held.layer_start:want.layer_end - held.layer_start, :,
              want.head_start - held.head_start:want.head_end - held.head_start].contiguous()


def _inside(want: KVSlice, held: KVSlice) -> bool:
    return (held.layer_start <= want.layer_start < want.layer_end <= held.layer_end
            and held.head_start <= want.head_start < want.head_end <= held.head_end)


class PrefillTransfer:
    def __init__(self, transport: Transport, rank: int, held: KVSlice, samples: bool,
                 layout: PrefillLayout | None, timeout_s: float, counters: TransferCounters,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`rank`: this rank's global rank, holding the KV of `held`; `samples`: whether it is
        the server's sampling rank (TP 0 of the last stage), whose request state (generator,
        logprobs) the first token carries; `layout`: rank 0's, what the bootstrap server
        answers (None on the other ranks)."""
        self.transport = transport
        self.rank = rank
        self.held = held
        self.samples = samples
        self.layout = layout
        self.timeout_s = timeout_s
        self.counters = counters
        self.clock = clock
        self.changed = threading.Event()
        self._lock = threading.Lock()
        self._rooms: dict[int, OutRoom] = {}
        self._early: dict[int, list[_Early]] = {}
        self._last_seen: dict[str, float] = {}  # decode session -> its last message
        self._peer_used: dict[str, float] = {}

    # -- the scheduler thread ---------------------------------------------------------------

    def open(self, room: int) -> None:
        with self._lock:
            state = self._rooms[room] = OutRoom(deadline=self.clock() + self.timeout_s)
            for early in self._early.pop(room, []):
                self._apply(state, early.message)

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
        """Send KV of prompt tokens [start, start + n) (n = k.shape[1]; `gather`'s K and V of
        this rank) to each decode rank, the slice it wants."""
        num_tokens, sent = int(k.shape[1]), 0
        for dest in self._dests(room):
            if dest.want is None:
                continue
            chunk = KVChunk(room=room, session=dest.session, start=start, num_tokens=num_tokens,
                            source=self.rank)
            part_k, part_v = _cut(k, self.held, dest.want), _cut(v, self.held, dest.want)
            sent += part_k.numel() * part_k.element_size() * 2
            frames = (_frame(part_k), _frame(part_v))
            self.transport.post(partial(self._send, endpoint=dest.endpoint, message=chunk,
                                        frames=frames))
        if sent:
            self.counters.sent(num_tokens, sent)

    def sends_kv(self, room: int) -> bool:
        """Whether a decode rank wants some of this rank's KV for the room (a rank holding only
        KV heads another prefill rank sends gathers nothing)."""
        return any(dest.want is not None for dest in self._dests(room))

    def send_done(self, room: int, num_tokens: int, first: FirstToken) -> None:
        """Tell every decode rank that all of this rank's KV went out; the sampling rank's
        KVDone carries `first`, the others' none."""
        dests = self._dests(room)
        if not dests:
            return
        with self._lock:
            self._rooms[room].advance(KVPoll.TRANSFERRING, self.clock() + self.timeout_s)
        for dest in dests:
            done = KVDone(room=room, session=dest.session, num_tokens=num_tokens,
                          source=self.rank, first=first if self.samples else None)
            self.transport.post(partial(self._send, endpoint=dest.endpoint, message=done))

    def abort(self, room: int, reason: str) -> None:
        """The room is over here: fail it and tell its decode, if one is known."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                return
            state.fail(reason)
            endpoints = [dest.endpoint for dest in state.dests.values()]
        message = KVAbort(room=room, reason=reason)
        for endpoint in endpoints:
            self.transport.post(partial(self._send, endpoint=endpoint, message=message))

    def close(self, room: int) -> None:
        with self._lock:
            state = self._rooms.pop(room, None)
        if state is not None and state.state == KVPoll.FAILED:
            self.counters.failed()

    def wait(self, timeout_s: float) -> None:
        """Until a room changes state or `timeout_s` passes."""
        self.changed.wait(timeout_s)
        self.changed.clear()

    def _dests(self, room: int) -> list[KVDest]:
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.state == KVPoll.FAILED:
                return []
            return list(state.dests.values())

    def _deadline_reason(self, state: OutRoom) -> str:
        if not state.all_dests():
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
                    self._early.setdefault(message.room, []).append(
                        _Early(message, self.clock()))
                return
            self._apply(state, message)
        self.changed.set()

    def _apply(self, state: OutRoom, message: KVDest | KVAck | KVAbort) -> None:
        if isinstance(message, KVDest):
            if message.want is not None and not _inside(message.want, self.held):
                state.fail(f"decode rank {message.rank} asked prefill rank {self.rank} for "
                           f"{message.want}, which it does not hold ({self.held})")
            elif state.state == KVPoll.BOOTSTRAPPING:
                state.dests[message.rank] = message
                if state.all_dests():
                    state.advance(KVPoll.WAITING)
        elif isinstance(message, KVAck):
            if not message.ok:
                state.fail(f"the decode server refused the KV: {message.message}")
            elif state.state == KVPoll.TRANSFERRING:
                state.acked.add(message.rank)
                if len(state.acked) == len(state.dests):
                    state.advance(KVPoll.SUCCESS)
        else:
            state.fail(f"the decode server ended the transfer: {message.reason}")

    def on_request(self, message: AnyKVMessage) -> KVMessage | None:
        assert self.layout is not None, "only rank 0 serves bootstrap requests"
        if isinstance(message, LayoutQuery):
            problem = incompatibility(self.layout.server, message.server, "this address")
            if problem is not None:  # the decode refuses this server with the same words
                logger.error("a decode server with %s asked for this server's layout: %s",
                             describe(message.server), problem)
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
                    if state.state in (KVPoll.FAILED, KVPoll.SUCCESS):
                        continue
                    for dest in state.dests.values():
                        if now - self._last_seen.get(dest.session, now) > LOST_AFTER_S:
                            changed |= state.fail(f"lost the decode server ({dest.endpoint}): "
                                                  f"no heartbeat for {LOST_AFTER_S:g} s")
            for room in [r for r, e in self._early.items() if now - e[0].at > self.timeout_s]:
                del self._early[room]
            idle = [e for e, used in self._peer_used.items() if now - used > PEER_IDLE_S]
        for endpoint in idle:
            del self._peer_used[endpoint]
            self.transport.drop_peer(endpoint)
        if changed:
            self.changed.set()
