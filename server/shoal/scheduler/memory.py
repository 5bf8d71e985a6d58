"""KV memory of requests: rows of the req→token table and the token slots they hold.

Allocation is check-then-commit: `can_*` answers first, the mutating call never half-succeeds.
"""

from __future__ import annotations

import torch

from shoal.engine.kv_pool import ReqToTokenPool, TokenSlotAllocator
from shoal.scheduler.request import Req


class ReqMemory:
    def __init__(self, req_to_token: ReqToTokenPool, allocator: TokenSlotAllocator) -> None:
        self.req_to_token = req_to_token
        self.allocator = allocator

    @property
    def num_free_slots(self) -> int:
        return self.allocator.num_free

    @property
    def num_free_rows(self) -> int:
        return self.req_to_token.num_free

    def assign_row(self, req: Req) -> None:
        row = self.req_to_token.alloc()
        assert row is not None, "caller must check num_free_rows first"
        req.row = row

    def alloc_slots(self, reqs: list[Req], extend_lens: list[int]) -> torch.Tensor:
        """Slots for each request's next `extend_len` tokens, written into the table.

        Returns the slots concatenated in request order (the batch's `out_cache_loc`).
        """
        slots = self.allocator.alloc(sum(extend_lens))
        assert slots is not None, "caller must check num_free_slots first"
        table = self.req_to_token.table
        if all(n == 1 for n in extend_lens):
            rows = torch.tensor([r.row for r in reqs], dtype=torch.int64, device=table.device)
            cols = torch.tensor([r.cached_len for r in reqs], dtype=torch.int64,
                                device=table.device)
            table[rows, cols] = slots
            return slots
        offset = 0
        for req, n in zip(reqs, extend_lens):
            table[req.row, req.cached_len:req.cached_len + n] = slots[offset:offset + n]
            offset += n
        return slots

    def release(self, req: Req) -> None:
        """Give back every slot and the row a request holds; its progress resets to nothing."""
        if req.row is None:
            return
        self.allocator.free(self.req_to_token.table[req.row, :req.cached_len].clone())
        self.req_to_token.free(req.row)
        req.row = None
        req.cached_len = 0
