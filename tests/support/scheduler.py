"""The scheduler on CPU with a fake model and fake IO: what the scheduler unit tests build on."""

from __future__ import annotations

import torch
import xgrammar as xgr

from shoal.engine.kv_pool import ReqToTokenPool, TokenSlotAllocator
from shoal.ipc.messages import (
    AnyMessage,
    ComponentReady,
    ControlReply,
    FinishReason,
    GenerateReq,
    LogprobParams,
    ReqTokenOut,
    SamplingParams,
)
from shoal.models.forward_batch import ForwardBatch
from shoal.scheduler.grammar import Grammars
from shoal.scheduler.memory import ReqMemory
from shoal.scheduler.prefix_cache import NoPrefixCache, RadixCache
from shoal.scheduler.scheduler import Scheduler, SchedulerConfig
from shoal.scheduler.speculation import NgramProposer
from shoal.scheduler.stop import StopChecker

VOCAB = 50
EOS = 0


class CountingModel:
    """Next token = input token + 1 (mod VOCAB, skipping EOS), at `batch.logits_at`; records
    each batch."""

    def __init__(self) -> None:
        self.batches: list[ForwardBatch] = []

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.batches.append(batch)
        last = batch.input_ids[batch.logits_at]
        nxt = (last % (VOCAB - 1)) + 1
        return torch.nn.functional.one_hot(nxt, VOCAB).float()


class LetterTokenizer:
    """Token i decodes to the letter i (mod 26): stop strings over token ids."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def letter_grammars() -> Grammars:
    """Token i is the letter i (mod 26), as `LetterTokenizer` decodes it; EOS stops."""
    letters = LetterTokenizer()
    vocab = ["</s>" if i == EOS else letters.decode([i]) for i in range(VOCAB)]
    return Grammars(lambda: xgr.TokenizerInfo(vocab, vocab_size=VOCAB, stop_token_ids=[EOS]))


class FakeIO:
    """Messages in from `inbox`; outputs and replies kept for the test to read."""

    def __init__(self) -> None:
        self.inbox: list[AnyMessage] = []
        self.outputs: list[ReqTokenOut] = []
        self.replies: list[ControlReply] = []

    def recv(self, blocking: bool) -> list[AnyMessage]:
        messages, self.inbox = self.inbox, []
        return messages

    def send_outputs(self, outputs: list[ReqTokenOut]) -> None:
        self.outputs += outputs

    def send_ready(self, ready: ComponentReady) -> None:
        pass

    def send_reply(self, reply: ControlReply) -> None:
        self.replies.append(reply)

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs if o.rid == rid for t in o.new_ids]

    def finish(self, rid: str) -> FinishReason:
        return next(o.finish for o in self.outputs if o.rid == rid and o.finish is not None)


def make_scheduler(num_slots: int = 4096, max_running: int = 64, chunk: int = 2048,
                   context: int = 1024, radix: bool = True, policy: str = "fcfs",
                   speculation: NgramProposer | None = None
                   ) -> tuple[Scheduler, FakeIO, CountingModel]:
    io, model = FakeIO(), CountingModel()
    allocator = TokenSlotAllocator(num_slots, torch.device("cpu"))
    memory = ReqMemory(ReqToTokenPool(max_running + 1, context, torch.device("cpu")), allocator,
                       RadixCache(allocator) if radix else NoPrefixCache())
    stop_checker = StopChecker(LetterTokenizer(), {EOS}, context)  # type: ignore[arg-type]
    scheduler = Scheduler(runner=model, memory=memory, io=io, stop_checker=stop_checker,
                          config=SchedulerConfig(context, max_running, chunk, policy,
                                                         speculation))
    return scheduler, io, model


def request(rid: str, prompt: list[int], max_new: int = 8, stream: bool = True,
            logprob: LogprobParams | None = None, **params: object) -> GenerateReq:
    """A greedy request unless `params` (more `SamplingParams` fields) say otherwise."""
    fields: dict[str, object] = {"max_new_tokens": max_new, "temperature": 0.0, **params}
    return GenerateReq(rid=rid, input_ids=prompt, stream=stream, logprob=logprob,
                       sampling=SamplingParams(**fields))  # type: ignore[arg-type]


def run_until_idle(scheduler: Scheduler, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        scheduler.step()
        if not scheduler.has_work:
            return
    raise AssertionError("scheduler did not become idle")


def run_overlapped_until_idle(scheduler: Scheduler, io: FakeIO, max_steps: int = 10_000) -> None:
    """The overlap loop, stopped once every request is done (the fake IO never blocks)."""
    real_recv = io.recv
    steps = 0

    def recv(blocking: bool) -> list[AnyMessage]:
        nonlocal steps
        steps += 1
        if (not scheduler.has_work and steps > 1) or steps > max_steps:
            scheduler.should_stop = True
        return real_recv(blocking)

    io.recv = recv  # type: ignore[method-assign]
    scheduler.run_forever_overlapped()
    assert not scheduler.has_work, "the overlap loop stopped with work left"
