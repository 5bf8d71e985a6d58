"""Tensor- and pipeline-parallel bookkeeping: who this rank is, and the collectives it calls.

A size-1 group never touches torch.distributed, so single-rank serving needs no process group.
A collective that fails raises `PeerLost` (exit 75): gloo reports a rank that went away as a
plain RuntimeError ("Connection closed by peer", "Connection reset by peer", a timeout), and
c10d as a `DistError` (a RuntimeError too).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shoal.lifecycle import PeerLost


@contextmanager
def peer_lost_on_error(what: str) -> Iterator[None]:
    """Wrap the collective calls (and nothing else) of a multi-rank step: their failure means a
    peer rank is gone."""
    try:
        yield
    except RuntimeError as exc:
        raise PeerLost(f"{what}: {exc}") from exc


@dataclass(frozen=True)
class ParallelGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: the default (world) group

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of size {self.size}")

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
                   ) -> torch.Tensor:
        """Reduce `x` in place across the group and return it."""
        if self.size > 1:
            with peer_lost_on_error("all_reduce"):
                dist.all_reduce(x, op=op, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with peer_lost_on_error("all_gather"):
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def shard(self, total: int) -> tuple[int, int]:
        """(start, size) of this rank's share of `total` items, which must divide evenly."""
        if total % self.size:
            raise ValueError(f"{total} does not split evenly over {self.size} ranks")
        size = total // self.size
        return self.rank * size, size


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` owns; earlier stages take the remainder."""
    if not 0 <= pp_rank < pp_size <= num_layers:
        raise ValueError(f"cannot give stage {pp_rank} of {pp_size} a share of {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)
