"""Acceptance: /metrics exposes the scheduler and request metrics with sane values after a load."""

from __future__ import annotations

import asyncio

import httpx

from tests.support.metrics import scrape
from tests.support.server import RunningServer
from tests.support.wait import wait_until

NUM_REQUESTS = 12
NEW_TOKENS = 6


async def load(base_url: str) -> int:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        async def one(i: int) -> int:
            r = await client.post("/generate", json={
                "text": f"Metrics probe {i}: the weather today is", "stream": True,
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True,
                                    "temperature": 0}})
            assert r.status_code == 200
            return NEW_TOKENS
        return sum(await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS))))


def _idle(metrics: dict[str, float]) -> dict[str, float] | None:
    return metrics if metrics.get("shoal:num_running_reqs", 1) == 0 else None


def test_metrics_after_a_load(default_server: RunningServer) -> None:
    before = scrape(default_server.base_url)
    generated = asyncio.run(load(default_server.base_url))
    after = wait_until(lambda: _idle(scrape(default_server.base_url)), timeout=10,
                       what="the gauges report no running request", interval=0.2)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("shoal:generation_tokens_total") == generated
    assert delta("shoal:prompt_tokens_total") >= NUM_REQUESTS * 5
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"shoal:{histogram}_count") == NUM_REQUESTS
        mean = delta(f"shoal:{histogram}_sum") / NUM_REQUESTS
        assert 0 < mean < 120
    assert delta("shoal:inter_token_latency_seconds_count") == NUM_REQUESTS * (NEW_TOKENS - 1)
    assert after["shoal:num_running_reqs"] == 0 and after["shoal:num_queue_reqs"] == 0
    assert 0 <= after["shoal:token_usage"] <= 1
    assert 0 <= after["shoal:cache_hit_rate"] <= 1
    assert after["shoal:gen_throughput"] >= 0
    assert after["shoal:num_retracted_reqs"] >= 0
