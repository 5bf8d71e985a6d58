"""How a scheduler rank gets its requests and sends its outputs, chosen once at startup.

    one rank           Rank0IO: read ZMQ, send token outputs to the detokenizer (an embedding
                       model's vectors to the api)
    rank 0 of many     BroadcastingIO: Rank0IO, then every round's messages to the other ranks
    every other rank   FollowerIO: receive rank 0's messages; send nothing

Every rank runs the same deterministic scheduler on the same inputs, so all ranks make identical
decisions; the round's messages travel as the same msgspec bytes rank 0 read.
"""

from __future__ import annotations

import torch.distributed as dist
import zmq

from shoal.engine.distributed import broadcast_bytes
from shoal.ipc import sockets
from shoal.ipc.messages import (
    AnyMessage,
    BatchEmbeddingOut,
    BatchTokenOut,
    ComponentReady,
    ControlReply,
    ReqEmbeddingOut,
    ReqTokenOut,
    decode_many,
    encode_many,
)

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

    def send_embeddings(self, outputs: list[ReqEmbeddingOut]) -> None:
        """An embedding model's vectors go straight to the api: there is no text to decode."""
        if outputs:
            sockets.send(self._to_api, BatchEmbeddingOut(outputs=outputs))

    def send_ready(self, ready: ComponentReady) -> None:
        sockets.send(self._to_api, ready)

    def send_reply(self, reply: ControlReply) -> None:
        sockets.send(self._to_api, reply)


class BroadcastingIO:
    """Rank 0 of many: read ZMQ, then hand the round's messages to every other rank."""

    def __init__(self, inner: Rank0IO, group: dist.ProcessGroup) -> None:
        self.inner = inner
        self.group = group

    def recv(self, blocking: bool) -> list[AnyMessage]:
        messages = self.inner.recv(blocking)
        broadcast_bytes(encode_many(messages) if messages else b"", src=0, group=self.group)
        return messages

    def send_outputs(self, outputs: list[ReqTokenOut]) -> None:
        self.inner.send_outputs(outputs)

    def send_ready(self, ready: ComponentReady) -> None:
        self.inner.send_ready(ready)

    def send_reply(self, reply: ControlReply) -> None:
        self.inner.send_reply(reply)


class FollowerIO:
    """Ranks other than 0: receive each round's messages from rank 0; send nothing."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def recv(self, blocking: bool) -> list[AnyMessage]:
        payload = broadcast_bytes(None, src=0, group=self.group)
        return decode_many(payload) if payload else []

    def send_outputs(self, outputs: list[ReqTokenOut]) -> None:
        pass

    def send_ready(self, ready: ComponentReady) -> None:
        pass

    def send_reply(self, reply: ControlReply) -> None:
        pass
