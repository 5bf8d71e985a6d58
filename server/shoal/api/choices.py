"""OpenAI choices: a request with P prompts and n samples each is P * n scheduler requests.

Choice i is sample `i % n` of prompt `i // n`. It gets rid `{rid}-{i}` (just `rid` when there is
one choice) and, when seeded, seed + its sample index, so seeded samples of a prompt differ from
each other yet reproduce. With n > 1 and a long prompt, a one-token request runs first so the
prefix cache holds the prompt and the n samples compute only its last token (the cache takes a
prompt when its request ends). Prompts of a batch are separate requests, so they share the prefix
cache like any other requests do.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from shoal.api.tokenizer_manager import (
    GenerateResult,
    IsDisconnected,
    TokenizerManager,
    abort_error,
)
from shoal.ipc.messages import (
    SEED_BOUND,
    BootstrapInfo,
    LogprobParams,
    ReqStrOut,
    SamplingParams,
)

PREFIX_WARMUP_MIN_TOKENS = 64  # below this, computing the prompt n times is cheaper than a step

T = TypeVar("T")


@dataclass
class Choices:
    tm: TokenizerManager
    rid: str
    prompts: list[list[int]]          # token ids of each prompt
    samplings: list[SamplingParams]   # of each prompt (how many new tokens fit differs)
    n: int
    logprob: LogprobParams | None
    is_disconnected: IsDisconnected | None
    bootstrap: BootstrapInfo | None = None  # a request `shoal router` paired: one choice only

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.n]

    def rid_of(self, index: int) -> str:
        return self.rid if self.num_choices == 1 else f"{self.rid}-{index}"

    def sampling_of(self, index: int) -> SamplingParams:
        sampling, sample = self.samplings[index // self.n], index % self.n
        seed = sampling.seed
        if sample == 0 or seed is None:
            return sampling
        shifted = seed + sample if seed + sample < SEED_BOUND else seed - sample
        return msgspec.structs.replace(sampling, seed=shifted)

    async def warm_prefix(self) -> None:
        """Compute each long prompt once, into the prefix cache, before its n > 1 samples share
        it. Not for prompt logprobs: those requests compute their whole prompt anyway."""
        wants_prompt_logprobs = self.logprob is not None and self.logprob.logprob_start_len >= 0
        if self.n == 1 or wants_prompt_logprobs:
            return
        warm = SamplingParams(max_new_tokens=1, temperature=0.0)
        await gather_all([
            self.tm.generate_full(ids, warm, is_disconnected=self.is_disconnected,
                                  rid=f"{self.rid}-prefix" if len(self.prompts) == 1
                                  else f"{self.rid}-prefix-{p}")
            for p, ids in enumerate(self.prompts) if len(ids) >= PREFIX_WARMUP_MIN_TOKENS])

    def streams(self) -> list[AsyncIterator[ReqStrOut]]:
        """Submit every choice now; one stream of chunks per choice."""
        return [self.tm.generate(self.prompt_of(i), self.sampling_of(i), rid=self.rid_of(i),
                                 stream=True, logprob=self.logprob,
                                 is_disconnected=self.is_disconnected, bootstrap=self.bootstrap)
                for i in range(self.num_choices)]

    async def results(self) -> list[GenerateResult]:
        return await gather_all([
            self.tm.generate_full(self.prompt_of(i), self.sampling_of(i), rid=self.rid_of(i),
                                  logprob=self.logprob, is_disconnected=self.is_disconnected,
                                  bootstrap=self.bootstrap)
            for i in range(self.num_choices)])


async def gather_all(awaitables: list[Awaitable[T]]) -> list[T]:
    """Every result in order; the first failure cancels the rest (aborting their requests)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def checked_outputs(outputs: AsyncIterator[ReqStrOut]) -> AsyncIterator[ReqStrOut]:
    """The chunks of one request; an aborted request raises (the stream reports an error)."""
    async with aclosing(outputs) as stream:
        async for out in stream:
            if out.finish is not None and out.finish.kind == "abort":
                raise abort_error(out.finish)
            yield out


async def merge_streams(streams: list[AsyncIterator[ReqStrOut]]
                        ) -> AsyncIterator[tuple[int, ReqStrOut]]:
    """(choice index, chunk) from all streams as chunks arrive; ends when every stream has.
    An aborted choice raises, and closing the merge closes (aborts) every stream."""
    if len(streams) == 1:
        async with aclosing(checked_outputs(streams[0])) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, ReqStrOut | Exception | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[ReqStrOut]) -> None:
        try:
            async with aclosing(checked_outputs(stream)) as outputs:
                async for out in outputs:
                    queue.put_nowait((index, out))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, exc))
            return
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
