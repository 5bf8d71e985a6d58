"""Rank consensus check: every rank's scheduling decisions must be the same, event for event.

The scheduler thread records events (batch composition with each request's progress,
retractions). A daemon thread compares them across ranks on a CPU group of its own: every
`interval_s` it all-reduces MIN of the pending count, hashes that many events with SHA-1, and
all-reduces MIN and MAX of the digest. Different digests mean the ranks diverged: every rank
logs its events, writes the termination message and exits 87. Nothing of this runs when the check
is off: the scheduler then has no recorder at all.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time

import torch
import torch.distributed as dist

from shoal.lifecycle import ExitCode, fail

logger = logging.getLogger(__name__)

DIGEST_WORDS = 3  # SHA-1's 20 bytes, zero-padded into three int64 words


class ConsensusChecker:
    def __init__(self, group: dist.ProcessGroup, component: str, rank: int,
                 corrupt_after_events: int | None = None, interval_s: float = 0.2) -> None:
        self.group = group
        self.component = component
        self.rank = rank
        self.corrupt_after_events = corrupt_after_events  # fault injection: diverge_consensus
        self.interval_s = interval_s
        self._pending: list[str] = []
        self._num_recorded = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rank-consensus", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def record(self, event: str) -> None:
        with self._lock:
            self._num_recorded += 1
            if self.corrupt_after_events is not None and \
                    self._num_recorded > self.corrupt_after_events:
                if self._num_recorded == self.corrupt_after_events + 1:
                    logger.warning("SHOAL_FAULT: rank %d now records corrupted events", self.rank)
                event += " (corrupted by SHOAL_FAULT)"
            self._pending.append(event)

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            with self._lock:
                count = torch.tensor([len(self._pending)], dtype=torch.int64)
            dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self.group)
            n = int(count.item())
            if n == 0:
                continue
            with self._lock:
                events, self._pending = self._pending[:n], self._pending[n:]
            low, high = self._digest(events), self._digest(events)
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.group)
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group)
            if not torch.equal(low, high):
                self._diverged(events)

    @staticmethod
    def _digest(events: list[str]) -> torch.Tensor:
        digest = hashlib.sha1("\n".join(events).encode()).digest().ljust(8 * DIGEST_WORDS, b"\0")
        return torch.tensor([int.from_bytes(digest[i:i + 8], "little", signed=True)
                             for i in range(0, len(digest), 8)], dtype=torch.int64)

    def _diverged(self, events: list[str]) -> None:
        logger.critical("rank consensus check failed on rank %d; its last %d events:\n%s",
                        self.rank, len(events), "\n".join(events))
        fail(ExitCode.CONSENSUS, self.component, self.rank,
             f"ranks disagreed on {len(events)} scheduling events")
