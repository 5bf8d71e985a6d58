"""The radix prefix cache: matching, splitting, ownership, locking and LRU eviction."""

from __future__ import annotations

import torch

from shoal.engine.kv_pool import TokenSlotAllocator
from shoal.scheduler.prefix_cache import RadixCache


def make_cache(size: int = 100) -> tuple[RadixCache, TokenSlotAllocator]:
    allocator = TokenSlotAllocator(size, torch.device("cpu"))
    return RadixCache(allocator), allocator


def cache_sequence(cache: RadixCache, allocator: TokenSlotAllocator, ids: list[int]) -> None:
    """What a finishing request does: allocate, insert, free its duplicates."""
    slots = allocator.alloc(len(ids))
    assert slots is not None
    already = cache.insert(ids, slots)
    allocator.free(slots[:already])


def test_match_returns_the_longest_cached_prefix_and_splits_nodes() -> None:
    cache, allocator = make_cache()
    cache_sequence(cache, allocator, [1, 2, 3, 4, 5])
    match = cache.match([1, 2, 3, 9])
    assert len(match.slots) == 3 and match.node.key == [1, 2, 3]
    assert len(cache.match([1, 2, 3, 4, 5, 6]).slots) == 5
    assert len(cache.match([7]).slots) == 0
    assert cache.total_size == 5 and allocator.num_free + cache.total_size == 100


def test_insert_reports_what_was_already_cached() -> None:
    cache, allocator = make_cache()
    cache_sequence(cache, allocator, [1, 2, 3])
    slots = allocator.alloc(5)
    assert slots is not None
    assert cache.insert([1, 2, 3, 4, 5], slots) == 3
    allocator.free(slots[:3])
    assert cache.total_size == 5
    assert allocator.num_free + cache.total_size == 100
    assert torch.equal(cache.match([1, 2, 3, 4, 5]).slots[3:], slots[3:])


def test_locked_prefixes_survive_eviction_lru_goes_first() -> None:
    cache, allocator = make_cache()
    cache_sequence(cache, allocator, [1, 2, 3, 4])
    cache_sequence(cache, allocator, [1, 2, 7, 8])
    cache_sequence(cache, allocator, [9, 9])
    locked = cache.match([1, 2, 3, 4])
    cache.lock(locked.node)
    assert cache.evictable_size == 4  # [7, 8] and [9, 9]; [1, 2, 3, 4] is protected
    cache.match([9, 9])  # touch: [7, 8] is now the least recently used
    assert cache.evict(1) == 2
    assert len(cache.match([1, 2, 7, 8]).slots) == 2
    assert len(cache.match([9, 9]).slots) == 2
    assert cache.evict(100) == 2
    assert len(cache.match([1, 2, 3, 4]).slots) == 4
    cache.unlock(locked.node)
    assert cache.evict(100) == 4
    assert cache.total_size == 0 and allocator.num_free == 100


def test_reset_frees_everything() -> None:
    cache, allocator = make_cache()
    cache_sequence(cache, allocator, [1, 2, 3])
    cache_sequence(cache, allocator, [1, 5])
    cache.reset()
    assert cache.total_size == 0 and allocator.num_free == 100
    assert len(cache.match([1, 2, 3]).slots) == 0
