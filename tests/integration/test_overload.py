"""Acceptance (issue 15): back-pressure. With `--max-running-requests 4 --max-queued-requests 4`,
64 simultaneous requests: 8 are admitted and complete, the other 56 get 429 (OpenAI error body,
`Retry-After`) at once, each before the first admitted request finishes; `/metrics` counts them;
nothing leaks. A request that cannot fit the KV pool gets a 400 that says the numbers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import RunningServer, start_server
from tests.support.wait import wait_until

RUNNING, QUEUED, CLIENTS = 4, 4, 64
NEW_TOKENS = 16
POOL = 4096


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(Path(tmp_path_factory.mktemp("overload")),
                          "--max-running-requests", str(RUNNING),
                          "--max-queued-requests", str(QUEUED),
                          "--max-total-tokens", str(POOL), "--enable-metrics")
    yield server
    assert server.stop() == 0, server.log()


async def burst(base_url: str) -> list[tuple[int, float, httpx.Response]]:
    """(client, seconds from the burst's start to the answer, answer) of every client."""
    limits = httpx.Limits(max_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        start = time.monotonic()

        async def one(i: int) -> tuple[int, float, httpx.Response]:
            r = await client.post("/v1/completions", json={
                "prompt": f"Overload {i}: once upon a time", "max_tokens": NEW_TOKENS,
                "ignore_eos": True, "temperature": 0})
            return i, time.monotonic() - start, r

        return list(await asyncio.gather(*(one(i) for i in range(CLIENTS))))


def rejected_total(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "shoal:rejected_requests_total")


def test_excess_requests_get_429_at_once(server: RunningServer) -> None:
    before = rejected_total(server.base_url)
    answers = asyncio.run(burst(server.base_url))
    admitted = [(t, r) for _, t, r in answers if r.status_code == 200]
    rejected = [(t, r) for _, t, r in answers if r.status_code != 200]
    assert len(admitted) == RUNNING + QUEUED, [r.status_code for _, _, r in answers]
    first_done = min(t for t, _ in admitted)
    for t, r in rejected:
        assert r.status_code == 429, r.text
        assert t < first_done
        assert r.headers["Retry-After"] == "1"
        error = r.json()["error"]
        assert "--max-queued-requests 4" in error["message"] and error["type"] and error["code"]
    for _, r in admitted:
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == NEW_TOKENS
    assert rejected_total(server.base_url) - before == CLIENTS - RUNNING - QUEUED
    info = wait_until(lambda: _idle(server), 30, "the server is idle after the burst")
    pool = info["scheduler"]
    assert pool["num_free_slots"] + pool["num_cached_slots"] == pool["num_total_slots"], pool
    again = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       json={"prompt": "After the burst", "max_tokens": 2})
    assert again.status_code == 200, again.text


def _idle(server: RunningServer) -> dict | None:
    info = httpx.get(server.base_url + "/server_info", timeout=10).json()
    busy = info["num_running_requests"] or info["scheduler"]["num_running_reqs"] \
        or info["scheduler"]["num_waiting_reqs"]
    return None if busy else info


def test_a_request_larger_than_the_kv_pool_gets_400_with_the_numbers(
        server: RunningServer) -> None:
    prompt = [5] * 10
    r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": POOL})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens"
    for number in (POOL, len(prompt), POOL + len(prompt)):
        assert str(number) in error["message"], error["message"]
