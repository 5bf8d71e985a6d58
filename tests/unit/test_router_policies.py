"""The router's policies and its prefix index, pure: which worker each request goes to."""

from __future__ import annotations

import random
from dataclasses import dataclass

from shoal.router.policies import (
    CacheAwareConfig,
    CacheAwarePolicy,
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
)
from shoal.router.prefix_index import BLOCK_CHARS, PrefixIndex, block_hashes


@dataclass
class W:
    url: str
    inflight: int = 0


def test_block_hashes_are_chained_and_whole_blocks_only() -> None:
    a = "x" * BLOCK_CHARS + "y" * BLOCK_CHARS + "tail"
    b = "x" * BLOCK_CHARS + "z" * BLOCK_CHARS
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == 2 and len(block_hashes("short")) == 0
    assert ha[0] == hb[0] and ha[1] != hb[1]
    # the same block after a different prefix is a different node
    assert block_hashes("y" * BLOCK_CHARS)[0] != ha[1]


def test_round_robin_takes_turns() -> None:
    workers = [W("a"), W("b"), W("c")]
    policy = RoundRobinPolicy()
    assert [policy.choose(workers, "").url for _ in range(6)] == list("abcabc")


def test_power_of_two_takes_the_less_loaded_of_two() -> None:
    workers = [W("a", 5), W("b", 0)]
    policy = PowerOfTwoPolicy(random.Random(0))
    assert {policy.choose(workers, "").url for _ in range(20)} == {"b"}


def test_random_spreads() -> None:
    workers = [W("a"), W("b")]
    policy = RandomPolicy(random.Random(1))
    assert {policy.choose(workers, "").url for _ in range(50)} == {"a", "b"}


def _tenant(i: int) -> str:
    return f"system prompt of tenant {i}: " + "lorem ipsum dolor " * 60


def test_cache_aware_keeps_each_tenant_on_one_worker_and_spreads_tenants() -> None:
    workers = [W("a"), W("b")]
    policy = CacheAwarePolicy()
    owners = {}
    for rep in range(3):
        for tenant in range(4):
            chosen = policy.choose(workers, _tenant(tenant) + f" question {rep}").url
            assert owners.setdefault(tenant, chosen) == chosen
    assert sorted(owners.values()) == ["a", "a", "b", "b"]  # a new prefix: the emptier worker


def test_cache_aware_ignores_a_small_match() -> None:
    workers = [W("a"), W("b")]
    policy = CacheAwarePolicy(CacheAwareConfig(cache_threshold=0.5))
    common = "c" * BLOCK_CHARS
    assert policy.choose(workers, common + "1" * 10 * BLOCK_CHARS).url == "a"
    # shares one block of eleven with a's prompt: below the threshold, so b (less remembered)
    assert policy.choose(workers, common + "2" * 10 * BLOCK_CHARS).url == "b"


def test_cache_aware_balances_load_when_imbalanced_and_still_records() -> None:
    policy = CacheAwarePolicy(CacheAwareConfig(balance_abs_threshold=4,
                                               balance_rel_threshold=1.5))
    text = _tenant(0)
    assert policy.choose([W("a"), W("b")], text).url == "a"
    busy = [W("a", inflight=10), W("b", inflight=1)]
    assert policy.choose(busy, text).url == "b"  # 10 - 1 > 4 and 10 > 1.5
    owner, matched = policy.index.match(block_hashes(text), ["b"])
    assert owner == "b" and matched == len(block_hashes(text))
    # within the thresholds the cache wins again
    assert policy.choose([W("a", inflight=3), W("b", inflight=1)], text).url == "a"


def test_the_index_forgets_least_recently_sent_prompts_beyond_its_cap() -> None:
    index = PrefixIndex(max_chars=4 * BLOCK_CHARS)
    first = block_hashes("1" * 3 * BLOCK_CHARS)
    second = block_hashes("2" * 3 * BLOCK_CHARS)
    index.insert("a", first)
    index.insert("a", second)
    assert index.size("a") == 4 * BLOCK_CHARS
    assert index.match(second, ["a"]) == ("a", 3)
    assert index.match(first, ["a"]) == (None, 0)  # its first blocks went first
