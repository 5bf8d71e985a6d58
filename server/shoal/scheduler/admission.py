"""Admission: which waiting requests join this step, and how many prompt tokens each computes.

A throwaway `PrefillAdder` is built every step from the step's budgets (`Scheduler.schedule`).
It first continues the prompts of running requests (`add_chunk`), then admits waiting ones
(`try_admit`, called by `Scheduler._admit`); each returns False / None on the first request that
does not fit, and the caller stops there (first come, first served). What it reserves for a
request's future is `future_slots`, scaled by `NewTokenRatio`.
"""

from __future__ import annotations

import math

from shoal.scheduler.request import Req

# Expected output beyond this many tokens is not reserved up front; a request that really runs
# that long and meets a full pool is retracted and recomputed later.
RESERVE_CLIP = 4096


def future_slots(req: Req, new_token_ratio: float = 1.0, computed_len: int | None = None) -> int:
    """KV slots a request is expected to take still: its uncomputed tokens (beyond
    `computed_len`, by default its own) plus the share `new_token_ratio` of its remaining output
    (most requests stop well before max_new_tokens)."""
    uncomputed = req.total_len - (req.computed_len if computed_len is None else computed_len)
    return uncomputed + math.ceil(min(req.remaining_new_tokens, RESERVE_CLIP) * new_token_ratio)


class NewTokenRatio:
    """How optimistic admission is about future output: starts cautious, grows bolder with every
    decode step that needs no retraction, and backs off when one does (as SGLang does)."""

    INITIAL = 0.7
    MINIMUM = 0.1
    DECAY_PER_STEP = (INITIAL - MINIMUM) / 600

    def __init__(self) -> None:
        self.value = self.INITIAL

    def on_step(self) -> None:
        self.value = max(self.MINIMUM, self.value - self.DECAY_PER_STEP)

    def on_retract(self) -> None:
        self.value = self.INITIAL


class PrefillAdder:
    def __init__(self, token_budget: int, free_slots: int, unreserved_slots: int,
                 free_req_pool_indices: int, new_token_ratio: float) -> None:
        self.token_budget = token_budget        # prompt tokens this step may compute
        self.free_slots = free_slots            # slots free right now, after this step's decodes
        self.unreserved_slots = unreserved_slots  # free slots not promised to admitted requests
        self.free_req_pool_indices = free_req_pool_indices  # requests that may still join
        self.new_token_ratio = new_token_ratio
        self.entries: list[tuple[Req, int]] = []  # (request, tokens it computes this step)

    def add_chunk(self, req: Req) -> bool:
        """Continue an admitted request's prompt; its slots were reserved at admission."""
        n = min(req.extend_len, self.token_budget, self.free_slots)
        if n <= 0:
            return False
        self._take(req, n)
        return True

    def try_admit(self, req: Req, prefix_len: int) -> int | None:
        """Admit a waiting request whose first `prefix_len` tokens are cached; returns how many
        tokens it computes this step, or None if it does not fit. The cached prefix is counted
        as taken too: locking it may take it out of the evictable slots."""
        need = future_slots(req, self.new_token_ratio, prefix_len) + prefix_len
        n = min(req.total_len - prefix_len, self.token_budget, self.free_slots - prefix_len)
        if self.free_req_pool_indices == 0 or need > self.unreserved_slots or n <= 0:
            return None
        self.free_req_pool_indices -= 1
        self.unreserved_slots -= need
        self.free_slots -= prefix_len
        self._take(req, n)
        return n

    def _take(self, req: Req, n: int) -> None:
        self.entries.append((req, n))
        self.token_budget -= n
        self.free_slots -= n
