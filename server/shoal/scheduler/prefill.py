"""Admission: which waiting requests join this step, and how many prompt tokens each computes.

A throwaway `PrefillAdder` is built every step from the step's budgets; `add_*` return False on
the first request that does not fit, and the caller stops there (first come, first served).
"""

from __future__ import annotations

from shoal.scheduler.request import Req

# Expected output beyond this many tokens is not reserved up front; a request that really runs
# that long and meets a full pool is retracted and recomputed later.
RESERVE_CLIP = 4096


def future_slots(req: Req) -> int:
    """KV slots a request may still take: its uncomputed tokens plus its remaining output."""
    return req.extend_len + min(req.remaining_new_tokens, RESERVE_CLIP)


class PrefillAdder:
    def __init__(self, token_budget: int, free_slots: int, unreserved_slots: int,
                 free_rows: int) -> None:
        self.token_budget = token_budget        # prompt tokens this step may compute
        self.free_slots = free_slots            # slots free right now, after this step's decodes
        self.unreserved_slots = unreserved_slots  # free slots not promised to admitted requests
        self.free_rows = free_rows
        self.rows: list[tuple[Req, int]] = []
        self.admitted: list[Req] = []

    def add_chunk(self, req: Req) -> bool:
        """Continue an admitted request's prompt; its slots were reserved at admission."""
        n = min(req.extend_len, self.token_budget, self.free_slots)
        if n <= 0:
            return False
        self._take(req, n)
        return True

    def try_admit(self, req: Req) -> bool:
        need = future_slots(req)
        if self.free_rows == 0 or need > self.unreserved_slots or self.token_budget <= 0:
            return False
        n = min(req.extend_len, self.token_budget, self.free_slots)
        if n <= 0:
            return False
        self.free_rows -= 1
        self.unreserved_slots -= need
        self.admitted.append(req)
        self._take(req, n)
        return True

    def _take(self, req: Req, n: int) -> None:
        self.rows.append((req, n))
        self.token_budget -= n
        self.free_slots -= n
