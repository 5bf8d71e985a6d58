"""What the ranks of one server agree on: each transfer's state, every step, and where each rank
listens, once at startup.

A transfer moves on only when every rank's share of it did: the ranks all-reduce their states
with MIN (FAILED is the lowest), as SGLang's `poll_and_all_reduce` does, so one rank's failure
fails the request on every rank and the ranks' scheduling decisions stay identical.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from shoal.engine.distributed import broadcast_bytes
from shoal.models.parallel import ParallelGroup


class KVPoll(enum.IntEnum):
    """A transfer's state on one rank; only ever rises, except to FAILED."""

    FAILED = 0
    BOOTSTRAPPING = 1   # prefill: no destination yet; decode: the prefill's layout unknown
    WAITING = 2         # prefill: a destination holds slots; decode: may preallocate and ask
    TRANSFERRING = 3    # KV on its way
    SUCCESS = 4         # prefill: the decode acknowledged; decode: every token written


def agree(states: list[KVPoll], ranks: ParallelGroup) -> list[KVPoll]:
    """Each state as the lowest over all ranks (every rank passes the same transfers, in the
    same order)."""
    if ranks.size == 1 or not states:
        return states
    lowest = ranks.all_reduce(torch.tensor(states, dtype=torch.int64), op=dist.ReduceOp.MIN)
    return [KVPoll(int(v)) for v in lowest.tolist()]


def gather_endpoints(endpoint: str, ranks: ParallelGroup) -> list[str]:
    """Every rank's transfer inbox, in global rank order (msgspec-free: plain UTF-8 bytes)."""
    if ranks.size == 1:
        return [endpoint]
    assert ranks.group is not None
    return [broadcast_bytes(endpoint.encode() if r == ranks.rank else None, src=r,
                            group=ranks.group).decode() for r in range(ranks.size)]
