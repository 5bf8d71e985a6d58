"""Rank-specific behaviour, chosen once at startup: how a rank gets requests, runs its pipeline
stage and learns the sampled tokens. A single-rank server uses none of this.

Every rank runs the same deterministic scheduler on the same inputs: rank 0 alone reads ZMQ and
broadcasts each round's messages (msgspec bytes) to the others, and the sampling rank broadcasts
each step's tokens, so all ranks make identical decisions.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from shoal.engine.distributed import RankLayout, broadcast_bytes
from shoal.engine.forward_batch import ForwardBatch
from shoal.engine.model_runner import ModelRunner
from shoal.engine.sampler import SamplingWork
from shoal.ipc.messages import (AnyMessage, ComponentReady, ControlReply, ReqTokenOut,
                                SamplingResult, decode_many, decode_sampling_result, encode_many,
                                encode_sampling_result)
from shoal.scheduler.io import Rank0IO
from shoal.scheduler.scheduler import local_sampling


class BroadcastingIO:
    """Rank 0: read ZMQ, then hand the round's messages to every other rank."""

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


class SharedSampling:
    """The sampling rank (TP 0 of the last stage) samples; every rank receives its tokens.

    A step without logprobs broadcasts a tensor of token ids. When the step asks for logprobs
    (every rank knows: the same requests everywhere), the whole `SamplingResult` travels as
    msgspec bytes, so rank 0 can send them and every rank records the same prompt progress."""

    def __init__(self, layout: RankLayout, group: dist.ProcessGroup) -> None:
        self.src = layout.sampler_rank
        self.is_src = layout.rank == self.src
        self.group = group

    def __call__(self, logits: torch.Tensor | None, work: SamplingWork) -> SamplingResult:
        if work.wants_logprobs:
            payload = encode_sampling_result(local_sampling(logits, work)) if self.is_src else None
            return decode_sampling_result(broadcast_bytes(payload, src=self.src, group=self.group))
        if self.is_src:
            tokens = torch.tensor(local_sampling(logits, work).tokens, dtype=torch.int64)
        else:
            tokens = torch.empty(len(work.reqs), dtype=torch.int64)
        dist.broadcast(tokens, src=self.src, group=self.group)
        return SamplingResult(tokens=tokens.tolist())


class PipelineStage:
    """One stage of a pipeline: receive hidden states from the previous stage, run this stage's
    layers, pass them on; only the last stage returns logits."""

    def __init__(self, runner: ModelRunner, layout: RankLayout) -> None:
        self.runner = runner
        self.layout = layout

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        hidden = residual = None
        if not self.layout.is_first_stage:
            src = self.layout.stage_peer(self.layout.pp_rank - 1)
            shape = (batch.num_tokens, self.runner.model_config.hidden_size)
            hidden = torch.empty(shape, dtype=self.runner.dtype, device=self.runner.device)
            residual = torch.empty_like(hidden)
            dist.recv(hidden, src=src)
            dist.recv(residual, src=src)
        out = self.runner.forward(batch, hidden, residual)
        if self.layout.is_last_stage:
            assert isinstance(out, torch.Tensor)
            return out
        assert isinstance(out, tuple)
        dst = self.layout.stage_peer(self.layout.pp_rank + 1)
        dist.send(out[0].contiguous(), dst=dst)
        dist.send(out[1].contiguous(), dst=dst)
        return None


class HangingRunner:
    """Fault injection (`hang_forward`): forwards normally `after_steps` times, then blocks."""

    def __init__(self, inner: PipelineStage | ModelRunner, after_steps: int) -> None:
        self.inner = inner
        self.remaining = after_steps

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        if self.remaining <= 0:
            threading.Event().wait()
        self.remaining -= 1
        return self.inner.forward(batch)  # type: ignore[return-value]
