"""How a rank learns each step's sampled tokens, chosen once at startup: it samples them itself
(`local_sampling`, one rank), or the sampling rank samples and broadcasts (`SharedSampling`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shoal.engine import sampler
from shoal.engine.distributed import RankLayout, broadcast_bytes
from shoal.engine.sampler import SamplingWork
from shoal.ipc.messages import SamplingResult, decode_sampling_result, encode_sampling_result
from shoal.models.parallel import peer_lost_on_error

# (logits or None, the step's sampling work) -> a token per request (and the logprobs asked
# for), the same on every rank
Sampling = Callable[[torch.Tensor | None, SamplingWork], SamplingResult]


def local_sampling(logits: torch.Tensor | None, work: SamplingWork) -> SamplingResult:
    assert logits is not None
    return sampler.run(logits, work)


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
        with peer_lost_on_error("broadcasting sampled tokens"):
            dist.broadcast(tokens, src=self.src, group=self.group)
        return SamplingResult(tokens=tokens.tolist())
