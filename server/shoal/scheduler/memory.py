"""KV memory of requests: entries of the req→token table, the slots they hold, the prefix cache.

A running request's entry `req_to_token[req_pool_idx]` maps positions to slots:

    [0 ........ cache_owned_len) [cache_owned_len ........ computed_len)
      matched in the prefix cache   computed by the request itself:
      (owned by the cache, locked)  owned by the request until it is released

Allocation is check-then-commit: callers check `num_available_slots` /
`num_free_req_pool_indices` first, and a mutating call never half-succeeds. Eviction is its own
call (`evict_for`), made before slots are allocated; `num_available_slots` counts what it could
free.
"""

from __future__ import annotations

import logging

import torch

from shoal.engine.kv_pool import ReqToTokenPool, TokenSlotAllocator
from shoal.scheduler.prefix_cache import PrefixCache, PrefixMatch
from shoal.scheduler.request import Req

logger = logging.getLogger(__name__)


class ReqMemory:
    def __init__(self, req_to_token: ReqToTokenPool, allocator: TokenSlotAllocator,
                 cache: PrefixCache) -> None:
        self.req_to_token = req_to_token
        self.allocator = allocator
        self.cache = cache

    @property
    def num_available_slots(self) -> int:
        """Free slots plus cached ones that could be evicted."""
        return self.allocator.num_free + self.cache.evictable_size

    @property
    def num_free_req_pool_indices(self) -> int:
        return self.req_to_token.num_free

    def match_prefix(self, req: Req) -> PrefixMatch:
        """The cached prefix of a waiting request; at least its last token is left to compute,
        so the forward produces the logits of the next token (and, for a request that wants
        prompt logprobs, every position still to score: `Req.max_prefix_match_len`)."""
        return self.cache.match(req.token_ids[:req.max_prefix_match_len])

    def acquire(self, req: Req, match: PrefixMatch) -> None:
        """Give an admitted request its req_to_token entry, starting from its cached prefix
        (locked until `release`)."""
        req_pool_idx = self.req_to_token.alloc()
        assert req_pool_idx is not None, "caller must check num_free_req_pool_indices first"
        matched = len(match.slots)
        self.cache.lock(match.node)
        self.req_to_token.table[req_pool_idx, :matched] = match.slots.to(
            self.req_to_token.table.device)
        req.req_pool_idx, req.prefix_node = req_pool_idx, match.node
        req.computed_len = req.cache_owned_len = matched
        if not req.was_admitted:
            req.prefix_hit_len = matched
            req.was_admitted = True

    def prealloc(self, req: Req) -> None:
        """Give a request whose prompt KV is computed elsewhere (a decode server's request,
        whose KV its prefill server sends) its entry and a slot for every prompt token. They
        count as computed from now on: nothing reads them before the transfer is complete, and
        an incomplete one is `abandon`ed, never cached. The caller checks room first."""
        num_tokens = len(req.input_ids)
        self.evict_for(num_tokens)
        req_pool_idx = self.req_to_token.alloc()
        slots = self.allocator.alloc(num_tokens)
        assert req_pool_idx is not None and slots is not None, "caller must check room first"
        self.req_to_token.table[req_pool_idx, :num_tokens] = slots
        req.req_pool_idx, req.prefix_node = req_pool_idx, None
        req.computed_len, req.cache_owned_len = num_tokens, 0
        req.was_admitted = True

    def evict_for(self, num_slots: int) -> None:
        """Evict cached prefixes (least recently used first) until `num_slots` slots are free."""
        if num_slots > self.allocator.num_free:
            self.cache.evict(num_slots - self.allocator.num_free)

    def alloc_slots(self, reqs: list[Req], extend_lens: list[int]) -> torch.Tensor:
        """Slots for each request's next `extend_len` tokens, written into the table. Returns the
        slots concatenated in request order (the batch's `out_cache_loc`)."""
        slots = self.allocator.alloc(sum(extend_lens))
        assert slots is not None, "caller must check num_available_slots and evict_for first"
        table = self.req_to_token.table
        if all(n == 1 for n in extend_lens):
            indices = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64,
                                   device=table.device)
            positions = torch.tensor([r.computed_len for r in reqs], dtype=torch.int64,
                                     device=table.device)
            table[indices, positions] = slots
            return slots
        offset = 0
        for req, n in zip(reqs, extend_lens):
            start = req.computed_len
            table[req.req_pool_idx, start:start + n] = slots[offset:offset + n]
            offset += n
        return slots

    def free_tail(self, req: Req, end: int) -> None:
        """Free the slots of a running request's positions [computed_len, end): K/V a forward
        wrote for tokens the request did not keep (rejected speculative proposals). Its
        req_to_token entry keeps the stale slots until the positions are written again."""
        assert req.req_pool_idx is not None
        self.allocator.free(self.req_to_token.table[req.req_pool_idx, req.computed_len:end])

    def cache_progress(self, req: Req) -> None:
        """Checkpoint a running request's computed tokens into the prefix cache (SGLang's
        `cache_unfinished_req`), so requests admitted from now on share them while this one is
        still running. The request switches to the cache's slots for tokens cached already (its
        duplicates are freed) and its lock moves to the end of what it computed. Only call this
        once the forward that computes those tokens has been launched: later forwards, the only
        ones that can read the slots, run after it."""
        if (not self.cache.shares or req.req_pool_idx is None
                or min(req.computed_len, len(req.token_ids)) <= req.cache_owned_len):
            return
        ids, _ = self._insert_computed(req)
        known = len(ids)
        match = self.cache.match(ids)
        assert len(match.slots) == known
        self.req_to_token.table[req.req_pool_idx, :known] = match.slots.to(
            self.req_to_token.table.device)
        self.cache.lock(match.node)
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        req.prefix_node, req.cache_owned_len = match.node, known

    def release(self, req: Req) -> None:
        """Hand a request's computed tokens to the prefix cache (slots it duplicates are freed),
        unlock its prefix and free its req_to_token entry; its progress resets to nothing.
        Positions whose token is still pending (the overlap loop) are not cached: their slots
        are freed."""
        if req.req_pool_idx is None:
            return
        ids, slots = self._insert_computed(req)
        self.allocator.free(slots[len(ids):])
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx, req.prefix_node = None, None
        req.computed_len = req.cache_owned_len = req.num_pending = 0
        req.epoch += 1

    def abandon(self, req: Req) -> None:
        """Free a request's entry and the slots it owns without caching what they hold (a
        transfer that did not complete); its progress resets to nothing."""
        if req.req_pool_idx is None:
            return
        self.allocator.free(
            self.req_to_token.table[req.req_pool_idx, req.cache_owned_len:req.computed_len])
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx, req.prefix_node = None, None
        req.computed_len = req.cache_owned_len = req.num_pending = 0
        req.epoch += 1

    def _insert_computed(self, req: Req) -> tuple[list[int], torch.Tensor]:
        """Insert the computed tokens whose ids are known into the cache and free the request's
        slots the cache already had. Returns those ids and the request's slots (all
        `computed_len` of them, pending positions included)."""
        assert req.req_pool_idx is not None
        slots = self.req_to_token.table[req.req_pool_idx, :req.computed_len].clone()
        ids = req.token_ids[:min(req.computed_len, len(req.token_ids))]
        already_cached = self.cache.insert(ids, slots[:len(ids)])
        self.allocator.free(slots[req.cache_owned_len:already_cached])
        return ids, slots

    def flush_cache(self) -> None:
        """Drop every cached prefix. Only valid when no request holds KV."""
        self.cache.reset()

    def check_idle_integrity(self) -> bool:
        """With no request holding KV, every slot is either free or cached."""
        free, cached, total = self.allocator.num_free, self.cache.total_size, self.allocator.size
        if free + cached != total:
            logger.error("KV pool leak: %d free + %d cached != %d slots (%d missing)",
                         free, cached, total, total - free - cached)
            return False
        return True
