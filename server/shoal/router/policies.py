"""Which worker takes a request. Each policy chooses among the healthy workers it is given
(never an empty list), by the request's prompt text and the router's own count of requests in
flight to each worker ("load").

    random        uniformly
    round_robin   in turn
    power_of_two  the less loaded of two drawn at random
    cache_aware   SGLang's rule: when the load is imbalanced (the gap between the most and the
                  least loaded is above --balance-abs-threshold AND the most is above
                  --balance-rel-threshold times the least), the least loaded; otherwise the
                  worker whose cache holds most of the prompt when that share is above
                  --cache-threshold, else the worker that remembers the least text (room for
                  a new prefix). The choice is always recorded in the prefix index.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from shoal.router.prefix_index import PrefixIndex, block_hashes


class Candidate(Protocol):
    url: str
    inflight: int


class Policy(Protocol):
    def choose(self, candidates: Sequence[Candidate], text: str) -> Candidate: ...


class RandomPolicy:
    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, candidates: Sequence[Candidate], text: str) -> Candidate:
        return self.rng.choice(list(candidates))


class RoundRobinPolicy:
    def __init__(self) -> None:
        self.counter = 0

    def choose(self, candidates: Sequence[Candidate], text: str) -> Candidate:
        chosen = candidates[self.counter % len(candidates)]
        self.counter += 1
        return chosen


class PowerOfTwoPolicy:
    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, candidates: Sequence[Candidate], text: str) -> Candidate:
        if len(candidates) == 1:
            return candidates[0]
        first, second = self.rng.sample(list(candidates), 2)
        return second if second.inflight < first.inflight else first


@dataclass(frozen=True)
class CacheAwareConfig:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**24


class CacheAwarePolicy:
    def __init__(self, config: CacheAwareConfig = CacheAwareConfig()) -> None:
        self.config = config
        self.index = PrefixIndex(config.max_tree_size)

    def choose(self, candidates: Sequence[Candidate], text: str) -> Candidate:
        hashes = block_hashes(text)
        chosen = self._pick(candidates, text, hashes)
        self.index.insert(chosen.url, hashes)
        return chosen

    def _pick(self, candidates: Sequence[Candidate], text: str, hashes: list[int]) -> Candidate:
        loads = [c.inflight for c in candidates]
        least_loaded = min(candidates, key=lambda c: c.inflight)
        if (max(loads) - min(loads) > self.config.balance_abs_threshold
                and max(loads) > min(loads) * self.config.balance_rel_threshold):
            return least_loaded
        by_url = {c.url: c for c in candidates}
        owner, matched = self.index.match(hashes, list(by_url))
        rate = matched * self.index.block_chars / max(len(text), 1)
        if owner is not None and rate > self.config.cache_threshold:
            return by_url[owner]
        return min(candidates, key=lambda c: (self.index.size(c.url), c.inflight))

    def forget(self, url: str) -> None:
        self.index.forget(url)


def make_policy(name: str, config: CacheAwareConfig) -> Policy:
    if name == "cache_aware":
        return CacheAwarePolicy(config)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "power_of_two":
        return PowerOfTwoPolicy()
    if name == "random":
        return RandomPolicy()
    raise ValueError(f"unknown policy {name!r}")
