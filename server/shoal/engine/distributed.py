"""One torch.distributed world per server: the tensor-parallel groups, and gloo CPU groups for
control traffic (request fan-out, sampled tokens, the rank consensus check).

Global rank = pp_rank * tp + tp_rank. Every rank creates every group, in the same order, as
torch.distributed requires.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.models.parallel import ParallelGroup, peer_lost_on_error

logger = logging.getLogger(__name__)

# A collective blocked longer than this fails instead of hanging forever. A hung peer is caught
# sooner by the scheduler watchdog; a dead peer fails the collective at once.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class RankLayout:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def sampler_rank(self) -> int:
        """The rank that samples: TP rank 0 of the last stage."""
        return (self.pp_size - 1) * self.tp_size

    def stage_peer(self, pp_rank: int) -> int:
        """The rank with this rank's TP position in stage `pp_rank`."""
        return pp_rank * self.tp_size + self.tp_rank


@dataclass(frozen=True)
class RankGroups:
    layout: RankLayout
    tp: ParallelGroup
    control: dist.ProcessGroup | None      # gloo, every rank: requests and sampled tokens
    consensus: dist.ProcessGroup | None    # gloo, every rank: the consensus checker's thread


def init_distributed(layout: RankLayout, dist_init_addr: str | None, device: torch.device,
                     with_consensus_group: bool) -> RankGroups:
    if layout.world_size == 1:
        return RankGroups(layout=layout, tp=ParallelGroup(), control=None, consensus=None)
    assert dist_init_addr is not None, "a multi-rank server needs --dist-init-addr"
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{dist_init_addr}",
                            world_size=layout.world_size, rank=layout.rank,
                            timeout=COLLECTIVE_TIMEOUT)
    tp_group = None
    for pp_rank in range(layout.pp_size):
        ranks = [pp_rank * layout.tp_size + t for t in range(layout.tp_size)]
        group = dist.new_group(ranks, backend=backend, timeout=COLLECTIVE_TIMEOUT)
        if pp_rank == layout.pp_rank:
            tp_group = group
    everyone = list(range(layout.world_size))
    control = dist.new_group(everyone, backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    consensus = (dist.new_group(everyone, backend="gloo", timeout=COLLECTIVE_TIMEOUT)
                 if with_consensus_group else None)
    logger.info("rank %d of %d joined (%s, tp %d/%d, pp %d/%d)", layout.rank, layout.world_size,
                backend, layout.tp_rank, layout.tp_size, layout.pp_rank, layout.pp_size)
    tp = ParallelGroup(rank=layout.tp_rank, size=layout.tp_size,
                       group=tp_group if layout.tp_size > 1 else None)
    return RankGroups(layout=layout, tp=tp, control=control, consensus=consensus)


def broadcast_bytes(payload: bytes | None, src: int, group: dist.ProcessGroup) -> bytes:
    """Send `payload` from global rank `src` to every rank of `group`: length first, then bytes."""
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    with peer_lost_on_error("broadcast"):
        dist.broadcast(size, src=src, group=group)
    if size.item() == 0:
        return b""
    if payload is not None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    with peer_lost_on_error("broadcast"):
        dist.broadcast(data, src=src, group=group)
    return data.numpy().tobytes()
