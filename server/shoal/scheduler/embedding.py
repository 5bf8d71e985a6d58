"""The scheduler of an embedding model: inputs batched by a token budget, one forward per batch.

An encoder has no decode phase and no KV cache: each input is read once and leaves as a vector.
A step picks the oldest waiting input and the waiting inputs closest to it in length (so little
of the batch is padding), up to `--chunked-prefill-size` padded tokens and
`--max-running-requests` inputs, and sends the vectors straight to the api. Generation requests
sent to an embedding server end at once with an error.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from shoal.ipc.messages import (
    AbortReq,
    AnyMessage,
    ControlReply,
    EmbedReq,
    FinishReason,
    FlushCacheReq,
    GenerateReq,
    ReqEmbeddingOut,
    ReqTokenOut,
    SchedulerInfoReq,
)

logger = logging.getLogger(__name__)


class EmbeddingIO(Protocol):
    def recv(self, blocking: bool) -> list[AnyMessage]: ...

    def send_outputs(self, outputs: list[ReqTokenOut]) -> None: ...

    def send_embeddings(self, outputs: list[ReqEmbeddingOut]) -> None: ...

    def send_reply(self, reply: ControlReply) -> None: ...


class Embedder(Protocol):
    @property
    def max_input_tokens(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def embed(self, batch: list[list[int]]) -> np.ndarray: ...


def pick_batch(lengths: list[int], max_tokens: int, max_inputs: int) -> list[int]:
    """Indices into `lengths` (the waiting inputs, oldest first) of the next batch: the oldest,
    then the others closest to it in length, while the batch padded to its longest input stays
    within `max_tokens` (the oldest always goes, however long)."""
    if not lengths:
        return []
    by_closeness = sorted(range(1, len(lengths)), key=lambda i: abs(lengths[i] - lengths[0]))
    chosen, longest = [0], lengths[0]
    for i in by_closeness:
        if len(chosen) == max_inputs:
            break
        padded = (len(chosen) + 1) * max(longest, lengths[i])
        if padded <= max_tokens:
            chosen.append(i)
            longest = max(longest, lengths[i])
    return sorted(chosen)


@dataclass
class EmbeddingCounters:
    num_inputs: int = 0        # embedded since start
    num_tokens: int = 0        # their tokens
    num_padded_tokens: int = 0  # tokens the forwards computed, padding included
    num_forward_steps: int = 0
    started: float = field(default_factory=time.monotonic)


class EmbeddingScheduler:
    def __init__(self, embedder: Embedder, io: EmbeddingIO, *, max_batch_tokens: int,
                 max_batch_inputs: int) -> None:
        self.embedder = embedder
        self.io = io
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_inputs = max_batch_inputs
        self.waiting: deque[EmbedReq] = deque()
        self.counters = EmbeddingCounters()
        self.should_stop = False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    @property
    def num_forward_steps(self) -> int:
        return self.counters.num_forward_steps

    def describe_running(self) -> str:
        lengths = [len(req.input_ids) for req in self.waiting]
        return (f"{len(self.waiting)} embedding inputs waiting (lengths {lengths[:32]}), "
                f"{self.counters.num_forward_steps} forward passes")

    def run_forever(self) -> None:
        while not self.should_stop:
            self.step()

    def step(self) -> None:
        for message in self.io.recv(blocking=not self.waiting):
            self.handle(message)
        if not self.waiting:
            return
        waiting = list(self.waiting)
        picked = pick_batch([len(req.input_ids) for req in waiting], self.max_batch_tokens,
                            self.max_batch_inputs)
        batch = [waiting[i] for i in picked]
        chosen = {id(req) for req in batch}
        self.waiting = deque(req for req in waiting if id(req) not in chosen)
        vectors = self.embedder.embed([req.input_ids for req in batch])
        counters = self.counters
        counters.num_forward_steps += 1
        counters.num_inputs += len(batch)
        counters.num_tokens += sum(len(req.input_ids) for req in batch)
        counters.num_padded_tokens += len(batch) * max(len(req.input_ids) for req in batch)
        self.io.send_embeddings([
            ReqEmbeddingOut(rid=req.rid, embedding=vector.astype("<f4").tobytes(),
                            prompt_tokens=len(req.input_ids))
            for req, vector in zip(batch, vectors)])

    def handle(self, message: AnyMessage) -> None:
        if isinstance(message, EmbedReq):
            problem = self._validate(message.input_ids)
            if problem:
                self.io.send_embeddings([ReqEmbeddingOut(
                    rid=message.rid, embedding=b"", prompt_tokens=len(message.input_ids),
                    error=problem)])
            else:
                self.waiting.append(message)
        elif isinstance(message, AbortReq):
            self.waiting = deque(req for req in self.waiting if req.rid != message.rid)
        elif isinstance(message, GenerateReq):
            self.io.send_outputs([ReqTokenOut(
                rid=message.rid, new_ids=[], prompt_tokens=len(message.input_ids),
                completion_tokens=0, cached_tokens=0, finish=FinishReason(
                    kind="abort", message="this server serves an embedding model: it computes "
                                          "embeddings (/v1/embeddings), not completions"))])
        elif isinstance(message, FlushCacheReq):
            self.io.send_reply(ControlReply(rid=message.rid, ok=True))  # there is no cache
        elif isinstance(message, SchedulerInfoReq):
            self.io.send_reply(ControlReply(rid=message.rid, ok=True, info=self.info()))
        else:
            logger.warning("embedding scheduler ignores unexpected message %s",
                           type(message).__name__)

    def info(self) -> dict[str, int]:
        counters = self.counters
        return {"num_waiting_reqs": len(self.waiting), "num_running_reqs": 0,
                "num_embedded_inputs": counters.num_inputs,
                "num_embedded_tokens": counters.num_tokens,
                "num_padded_tokens": counters.num_padded_tokens,
                "num_forward_steps": counters.num_forward_steps}

    def _validate(self, ids: list[int]) -> str | None:
        if not ids:
            return "the input is empty"
        limit = self.embedder.max_input_tokens
        if len(ids) > limit:
            return (f"the input ({len(ids)} tokens) is longer than the model's maximum input "
                    f"length ({limit} tokens)")
        vocab = self.embedder.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            return f"token id {bad} is out of the vocabulary [0, {vocab})"
        return None
