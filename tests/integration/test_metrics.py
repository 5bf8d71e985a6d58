"""Acceptance: /metrics exposes the scheduler and request metrics, and after a known load they
move by exactly that load and agree with /server_info."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from transformers import PreTrainedTokenizerBase

from tests.support.metrics import scrape
from tests.support.server import RunningServer
from tests.support.wait import wait_until

NUM_REQUESTS = 12
NEW_TOKENS = 6
PREFIX = "Metrics probe: the weather report for the coast today says that the wind is"


async def load(base_url: str, prompts: list[list[int]]) -> int:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        async def one(ids: list[int]) -> int:
            r = await client.post("/generate", json={
                "input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True,
                                    "temperature": 0}})
            assert r.status_code == 200
            return NEW_TOKENS
        return sum(await asyncio.gather(*(one(ids) for ids in prompts)))


def scheduler_info(base_url: str) -> dict[str, int]:
    return httpx.get(base_url + "/server_info", timeout=30).json()["scheduler"]


def _reported_idle(base_url: str) -> tuple[dict[str, float], dict[str, int]] | None:
    """/metrics and /server_info once the scheduler's gauges come from its idle report (set
    once per idle period): no request running, the hit rate the scheduler's counters give."""
    metrics, info = scrape(base_url), scheduler_info(base_url)
    rate = info["num_prefix_hit_tokens"] / info["num_prompt_tokens"]
    if metrics.get("shoal:num_running_reqs", 1) == 0 and info["num_running_reqs"] == 0 \
            and metrics.get("shoal:cache_hit_rate") == pytest.approx(rate):
        return metrics, info
    return None


def test_metrics_after_a_load(default_server: RunningServer,
                              tokenizer: PreTrainedTokenizerBase) -> None:
    """A prefix computed once, then NUM_REQUESTS prompts that extend it: the counters move by
    exactly the traffic, and the gauges, scraped idle, say what /server_info says."""
    url = default_server.base_url
    prefix = tokenizer.encode(PREFIX)
    prompts = [prefix + tokenizer.encode(f" number {i}.", add_special_tokens=False)
               for i in range(NUM_REQUESTS)]
    asyncio.run(load(url, [prefix]))  # the prefix is in the cache from now on
    before, info_before = scrape(url), scheduler_info(url)
    generated = asyncio.run(load(url, prompts))
    after, info = wait_until(lambda: _reported_idle(url), timeout=10,
                             what="the gauges report the idle scheduler's numbers",
                             interval=0.2)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("shoal:generation_tokens_total") == generated
    assert delta("shoal:prompt_tokens_total") == sum(len(p) for p in prompts)
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"shoal:{histogram}_count") == NUM_REQUESTS
        mean = delta(f"shoal:{histogram}_sum") / NUM_REQUESTS
        assert 0 < mean < 120
    assert delta("shoal:inter_token_latency_seconds_count") == NUM_REQUESTS * (NEW_TOKENS - 1)
    assert after["shoal:num_running_reqs"] == 0 and after["shoal:num_queue_reqs"] == 0
    # idle: every KV slot is free or held by the prefix cache, unlocked
    assert after["shoal:token_usage"] == 0
    # every prompt found the prefix (all but its last token, which is computed again) cached
    hits = info["num_prefix_hit_tokens"] - info_before["num_prefix_hit_tokens"]
    assert hits >= NUM_REQUESTS * (len(prefix) - 1)
    assert after["shoal:num_retracted_reqs"] == info["num_retracted_reqs"] == \
        info_before["num_retracted_reqs"]  # a 65,536-token pool retracts none of these
    # gen_throughput is the rate over the last log interval: an idle scrape may see 0
    assert "shoal:gen_throughput" in after
