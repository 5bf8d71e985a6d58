"""ZMQ endpoints of one server, all `ipc://` paths inside the server's private run directory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq

from shoal.ipc.messages import AnyMessage, Message, decode, encode

# synchronous sockets (no zmq.asyncio): every call returns its result, not an awaitable
Socket = zmq.Socket[bytes]
Context = zmq.Context[Socket]


@dataclass(frozen=True)
class Endpoints:
    """The three PULL sockets of a server; each is bound by its reader."""

    run_dir: str

    def _path(self, name: str) -> str:
        return f"ipc://{os.path.join(self.run_dir, name)}.sock"

    @property
    def scheduler_input(self) -> str:  # bound by scheduler rank 0
        return self._path("scheduler")

    @property
    def detokenizer_input(self) -> str:  # bound by the detokenizer
        return self._path("detokenizer")

    @property
    def api_input(self) -> str:  # bound by the api process
        return self._path("api")


def make_run_dir(path: str) -> str:
    Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def pull_socket(ctx: Context, endpoint: str) -> Socket:
    sock: Socket = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(endpoint)
    return sock


def push_socket(ctx: Context, endpoint: str) -> Socket:
    sock: Socket = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    return sock


def send(sock: Socket, message: Message) -> None:
    sock.send(encode(message), copy=False)


def recv(sock: Socket) -> AnyMessage:
    return decode(sock.recv(copy=False).bytes)


def recv_nowait(sock: Socket) -> list[AnyMessage]:
    messages: list[AnyMessage] = []
    while True:
        try:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return messages
        messages.append(decode(frame.bytes))
