"""Scheduler I/O: rank 0 reads requests from ZMQ and sends token outputs on.

Rank-specific behaviour is chosen once, at startup, by picking the IO class.
"""

from __future__ import annotations

import zmq

from shoal.ipc import sockets
from shoal.ipc.messages import (AnyMessage, BatchTokenOut, ComponentReady, ControlReply,
                                ReqTokenOut)

IDLE_POLL_MS = 500


class Rank0IO:
    def __init__(self, endpoints: sockets.Endpoints) -> None:
        self._ctx = zmq.Context()
        self._input = sockets.pull_socket(self._ctx, endpoints.scheduler_input)
        self._to_detokenizer = sockets.push_socket(self._ctx, endpoints.detokenizer_input)
        self._to_api = sockets.push_socket(self._ctx, endpoints.api_input)

    def recv(self, blocking: bool) -> list[AnyMessage]:
        """Everything queued now; when `blocking`, first wait up to IDLE_POLL_MS for a message."""
        if blocking:
            self._input.poll(IDLE_POLL_MS)
        return sockets.recv_nowait(self._input)

    def send_outputs(self, outputs: list[ReqTokenOut]) -> None:
        if outputs:
            sockets.send(self._to_detokenizer, BatchTokenOut(outputs=outputs))

    def send_ready(self, ready: ComponentReady) -> None:
        sockets.send(self._to_api, ready)

    def send_reply(self, reply: ControlReply) -> None:
        sockets.send(self._to_api, reply)
