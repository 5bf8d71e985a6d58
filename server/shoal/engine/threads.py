"""How many CPU threads a rank's torch runs on (docs/operations.md, "Multi-rank servers")."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from shoal.kernels.linear_kernels import LARGE_FORWARD_TOKENS


def torch_threads_per_rank(num_cores: int, ranks_on_this_host: int, spare_core: bool) -> int:
    """Cores per local rank, less one core per host with `spare_core`: left to the overlap loop's
    worker thread, the api and the detokenizer (OpenMP threads that outnumber the free cores
    stall at every barrier), or to the api of an embedding model; without it the forward is
    what the host runs."""
    return max(1, (num_cores - spare_core) // ranks_on_this_host)


def large_forward_threads_per_rank(num_cores: int, ranks_on_this_host: int) -> int:
    """Cores per local rank, none left over: for forwards of LARGE_FORWARD_TOKENS tokens or more
    (a decode batch of 12+ rows, prefill-heavy steps), whose products are long enough that a
    thread the OS lends to the api for a moment delays a barrier a little; beside the overlap
    loop's worker, a step of a few rows is many short ops, and it stalls at every one
    (docs/operations.md)."""
    return max(1, num_cores // ranks_on_this_host)


@dataclass(frozen=True)
class RankThreads:
    base: int           # torch threads of the rank's forward
    large_forward: int  # threads of a forward of LARGE_FORWARD_TOKENS tokens or more

    @classmethod
    def for_host(cls, num_cores: int, ranks_on_this_host: int, spare_core: bool
                 ) -> RankThreads:
        return cls(torch_threads_per_rank(num_cores, ranks_on_this_host, spare_core),
                   large_forward_threads_per_rank(num_cores, ranks_on_this_host))

    def for_tokens(self, num_tokens: int) -> int:
        return self.large_forward if num_tokens >= LARGE_FORWARD_TOKENS else self.base


@contextmanager
def forward_threads(threads: RankThreads | None, num_tokens: int) -> Iterator[None]:
    """Within this block (one forward of `num_tokens` tokens, in the thread that runs it), torch
    runs on `threads.for_tokens(num_tokens)` threads, then returns to `threads.base`; with
    `threads` None the count is left alone."""
    if threads is None or threads.for_tokens(num_tokens) == threads.base:
        yield
        return
    torch.set_num_threads(threads.for_tokens(num_tokens))
    try:
        yield
    finally:
        torch.set_num_threads(threads.base)
