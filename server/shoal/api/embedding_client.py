"""The api's side of embedding requests: each input goes to the scheduler as its own `EmbedReq`
(so inputs of many requests batch together there), and its vector comes back on the api socket
in a `BatchEmbeddingOut`, routed here by rid."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from shoal.ipc.messages import AbortReq, BatchEmbeddingOut, EmbedReq, Message, ReqEmbeddingOut


class EmbeddingClient:
    def __init__(self, send: Callable[[Message], None]) -> None:
        self._send = send
        self._pending: dict[str, asyncio.Future[ReqEmbeddingOut]] = {}

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def embed(self, inputs: list[list[int]]) -> list[ReqEmbeddingOut]:
        """Every input's vector (or refusal), in order. Inputs still queued when the caller is
        cancelled are aborted."""
        loop = asyncio.get_running_loop()
        rids = [f"embed-{uuid.uuid4().hex}" for _ in inputs]
        futures = [loop.create_future() for _ in inputs]
        self._pending.update(zip(rids, futures))
        try:
            for rid, ids in zip(rids, inputs):
                self._send(EmbedReq(rid=rid, input_ids=ids))
            return list(await asyncio.gather(*futures))
        finally:
            for rid, future in zip(rids, futures):
                self._pending.pop(rid, None)
                if future.cancelled() or not future.done():
                    self._send(AbortReq(rid=rid))

    def route(self, message: BatchEmbeddingOut) -> None:
        for out in message.outputs:
            future = self._pending.get(out.rid)
            if future is not None and not future.done():
                future.set_result(out)
