"""The I/O thread that owns one rank's KV-channel sockets.

ZMQ sockets are not thread-safe, so one thread owns them all; other threads hand it work with
`post(fn)`, and `fn(transport)` runs on the I/O thread (a pipe wakes its poller):

    inbox    PULL bound at tcp://host:port      transfer messages from peer ranks
    peers    a PUSH per peer inbox              connected on first send, dropped on failure
    server   ROUTER at the bootstrap port       a prefill's rank 0: LayoutQuery, Ping
    clients  a DEALER per bootstrap address     a decode rank's queries and pings

Incoming messages go to the rank's `Side` (its prefill or decode end), on the I/O thread; so
does a tick every TICK_S, for heartbeats and deadlines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec
import zmq

from shoal.disaggregation.messages import AnyKVMessage, KVMessage, decode, encode

logger = logging.getLogger(__name__)

TICK_S = 0.1
CLIENT_QUEUE = 64  # requests a client queues while its bootstrap server is unreachable
Buffer = bytes | memoryview


class Side(Protocol):
    def on_message(self, message: AnyKVMessage, frames: list[zmq.Frame]) -> None:
        """A transfer message in the inbox, with the raw frames that followed it."""

    def on_request(self, message: AnyKVMessage) -> KVMessage | None:
        """A request to the bootstrap server; the reply (None: no reply)."""

    def on_reply(self, address: str, message: AnyKVMessage) -> None:
        """A bootstrap server's reply to this rank's client for `address` (host:port)."""

    def on_tick(self, now: float) -> None:
        """Every TICK_S: heartbeats and deadlines."""


class Transport:
    def __init__(self, inbox_endpoint: str, server_endpoint: str | None = None,
                 advertised_inbox: str | None = None) -> None:
        """Bind the inbox (and the bootstrap server) now; peers are told `advertised_inbox`
        (default: the inbox endpoint), the inbox's address as they reach it."""
        self.inbox_endpoint = advertised_inbox or inbox_endpoint
        self._ctx = zmq.Context()
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.bind(inbox_endpoint)
        self._server: zmq.Socket | None = None
        if server_endpoint is not None:
            self._server = self._ctx.socket(zmq.ROUTER)
            self._server.setsockopt(zmq.LINGER, 0)
            self._server.bind(server_endpoint)
        self._peers: dict[str, zmq.Socket] = {}
        self._clients: dict[str, zmq.Socket] = {}
        self._posted: queue.SimpleQueue[Callable[[Transport], None]] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._poller = zmq.Poller()
        for sock in (self._inbox, self._server):
            if sock is not None:
                self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._wake_read, zmq.POLLIN)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._side: Side | None = None

    # -- any thread -------------------------------------------------------------------------

    def start(self, side: Side) -> None:
        self._side = side
        self._thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self._thread.start()

    def post(self, fn: Callable[[Transport], None]) -> None:
        """Run `fn(self)` on the I/O thread, after what was posted before."""
        self._posted.put(fn)
        os.write(self._wake_write, b"\0")

    def close(self) -> None:
        def stop(transport: Transport) -> None:
            transport._stopping = True
        self.post(stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)
        os.close(self._wake_read)
        os.close(self._wake_write)

    # -- the I/O thread ---------------------------------------------------------------------

    def send(self, endpoint: str, message: KVMessage, frames: Sequence[Buffer] = ()) -> None:
        """Queue `message` (and raw frames) for the inbox at `endpoint`; never blocks."""
        sock = self._peers.get(endpoint)
        if sock is None:
            sock = self._peers[endpoint] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        sock.send_multipart([encode(message), *frames], copy=False)

    def drop_peer(self, endpoint: str) -> None:
        """Close the socket to a peer inbox, with whatever it still queues (a dead peer's)."""
        sock = self._peers.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def ask(self, address: str, message: KVMessage) -> None:
        """Send a request to the bootstrap server at `address` (host:port); the reply goes to
        `Side.on_reply`. Queued until the connection is up."""
        sock = self._clients.get(address)
        if sock is None:
            sock = self._clients[address] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, CLIENT_QUEUE)
            sock.connect(f"tcp://{address}")
            self._poller.register(sock, zmq.POLLIN)
        with contextlib.suppress(zmq.Again):  # a full queue: the server is not there anyway
            sock.send(encode(message), zmq.NOBLOCK)

    def drop_client(self, address: str) -> None:
        sock = self._clients.pop(address, None)
        if sock is not None:
            self._poller.unregister(sock)
            sock.close(linger=0)

    def _run(self) -> None:
        assert self._side is not None
        next_tick = time.monotonic()
        while not self._stopping:
            events = dict(self._poller.poll(max(0.0, next_tick - time.monotonic()) * 1000))
            if self._wake_read in events:
                self._run_posted()
            if self._inbox in events:
                self._drain_inbox()
            if self._server is not None and self._server in events:
                self._serve()
            for address, sock in list(self._clients.items()):
                if sock in events:
                    self._drain_client(address, sock)
            now = time.monotonic()
            if now >= next_tick:
                self._guarded(self._side.on_tick, now)
                next_tick = now + TICK_S

    def _run_posted(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                fn = self._posted.get_nowait()
            except queue.Empty:
                return
            self._guarded(fn, self)

    def _drain_inbox(self) -> None:
        assert self._side is not None
        while True:
            try:
                frames = self._inbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            message = self._decode(frames[0].buffer, "inbox")
            if message is not None:
                self._guarded(self._side.on_message, message, frames[1:])

    def _serve(self) -> None:
        assert self._side is not None and self._server is not None
        while True:
            try:
                identity, payload = self._server.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not [identity, payload]: not a client of ours
                continue
            message = self._decode(payload, "bootstrap server")
            if message is None:
                continue
            reply = self._guarded(self._side.on_request, message)
            if reply is not None:
                self._server.send_multipart([identity, encode(reply)])

    def _drain_client(self, address: str, sock: zmq.Socket) -> None:
        assert self._side is not None
        while True:
            try:
                payload = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = self._decode(payload, f"bootstrap server {address}")
            if message is not None:
                self._guarded(self._side.on_reply, address, message)
            if address not in self._clients:  # the side dropped it
                return

    @staticmethod
    def _decode(payload: Buffer, where: str) -> AnyKVMessage | None:
        try:
            return decode(payload)
        except msgspec.DecodeError:
            logger.warning("dropping an undecodable message from the %s (%d bytes)", where,
                           len(payload))
            return None

    @staticmethod
    def _guarded(fn: Callable[..., KVMessage | None], *args: object) -> KVMessage | None:
        """One message's handling must not stop the thread every transfer of the rank needs."""
        try:
            return fn(*args)
        except Exception:
            logger.exception("KV transfer: handling failed")
            return None
