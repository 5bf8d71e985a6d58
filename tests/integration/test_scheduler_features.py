"""Acceptance (scheduler): prefix cache, retraction under a small pool, chunked prefill, aborts."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.support.reference import assert_same_or_tie, greedy
from tests.support.server import RunningServer, start_server
from tests.support.wait import wait_until

WORDS = ["lantern", "harbor", "meadow", "copper", "violin", "glacier", "orchard", "pepper",
         "canyon", "ribbon", "thunder", "marble", "saddle", "quartz", "willow", "falcon"]


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def generate(client: httpx.Client, text: str, max_new: int, **extra: object) -> dict:
    r = client.post("/generate", json={"text": text, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, **extra}})
    assert r.status_code == 200, r.text
    return r.json()


def pool(client: httpx.Client) -> dict:
    return client.get("/server_info").json()["scheduler"]


def test_shared_prefix_is_cached_and_output_unchanged(default_server: RunningServer,
                                                      model_path: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prefix = "Here is a list of words to remember: " + words(600, seed=1) + "\n"
    assert len(tokenizer.encode(prefix)) >= 500
    with httpx.Client(base_url=default_server.base_url, timeout=300) as client:
        generate(client, prefix + "Question one: which word comes first?", 8)
        cached = generate(client, prefix + "Question two: which word comes last?", 16)
        assert cached["meta_info"]["cached_tokens"] >= 500
        assert client.post("/flush_cache").status_code == 200
        uncached = generate(client, prefix + "Question two: which word comes last?", 16)
        assert uncached["meta_info"]["cached_tokens"] == 0
    assert cached["output_ids"] == uncached["output_ids"]


def test_disconnect_frees_slots_within_a_second(default_server: RunningServer) -> None:
    with httpx.Client(base_url=default_server.base_url, timeout=60) as client:
        baseline = pool(client)
        assert baseline["num_running_reqs"] == 0
        with client.stream("POST", "/generate", json={
                "text": words(50, seed=2), "stream": True,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}) as r:
            chunks: list[dict] = []
            for line in r.iter_lines():
                if line.startswith("data:"):
                    chunks.append(json.loads(line.removeprefix("data:")))
                if len(chunks) == 3:
                    break
            running = pool(client)
            assert running["num_running_reqs"] == 1, (
                f"{running}\nchunks: {chunks}\nserver log:\n{default_server.log()[-4000:]}")
            assert all("error" not in c and c["meta_info"]["finish_reason"] is None
                       for c in chunks), chunks
        closed = time.monotonic()
        wait_until(lambda: not pool(client)["num_running_reqs"], 5, interval=0.05,
                   what="the disconnected request freed")
        freed_after = time.monotonic() - closed
        after = pool(client)
    assert after["num_running_reqs"] == 0 and freed_after < 1.0
    assert after["num_free_slots"] + after["num_cached_slots"] == after["num_total_slots"]


@pytest.fixture(scope="module")
def small_pool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(Path(tmp_path_factory.mktemp("small-pool")),
                          "--max-total-tokens", "384", "--chunked-prefill-size", "256")
    yield server
    server.stop()


def test_small_pool_retracts_and_outputs_equal_solo_runs(small_pool_server: RunningServer,
                                                         model_path: str) -> None:
    bodies = [{"text": f"Story {i}: " + words(8, seed=100 + i),
               "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
              for i in range(32)]

    async def run(concurrent: bool) -> list[list[int]]:
        async with httpx.AsyncClient(base_url=small_pool_server.base_url, timeout=600) as c:
            async def one(body: dict) -> list[int]:
                r = await c.post("/generate", json=body)
                assert r.status_code == 200, r.text
                return r.json()["output_ids"]
            if concurrent:
                return list(await asyncio.gather(*(one(b) for b in bodies)))
            return [await one(b) for b in bodies]

    together = asyncio.run(run(concurrent=True))
    with httpx.Client(base_url=small_pool_server.base_url) as client:
        info = pool(client)
    assert info["num_retracted_reqs"] > 0
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    assert info["num_free_slots"] + info["num_cached_slots"] == info["num_total_slots"]
    alone = asyncio.run(run(concurrent=False))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    for body, got, solo in zip(bodies, together, alone):
        assert len(got) == 16
        assert_same_or_tie(model_path, tokenizer.encode(body["text"]), solo, got)


def test_chunked_prefill_matches_and_interleaves(tmp_path: Path, model_path: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    long_ids = tokenizer.encode(words(3500, seed=3))[:3000]
    assert len(long_ids) == 3000
    server = start_server(tmp_path, "--max-total-tokens", "8192", "--chunked-prefill-size", "256")
    try:
        stream_times: list[float] = []

        async def stream_other() -> None:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as c, c.stream(
                    "POST", "/generate", json={
                        "text": "Count slowly:", "stream": True,
                        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True,
                                            "temperature": 0}}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:") and line != "data: [DONE]":
                        stream_times.append(time.monotonic())

        async def long_prompt() -> tuple[float, float, dict]:
            while len(stream_times) < 3:
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as c:
                sent = time.monotonic()
                first = None
                final: dict = {}
                async with c.stream("POST", "/generate", json={
                        "input_ids": long_ids, "stream": True,
                        "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                            "ignore_eos": True}}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:") and line != "data: [DONE]":
                            first = first or time.monotonic()
                            final = json.loads(line[5:])
                assert first is not None
                return sent, first, final

        async def both() -> tuple[float, float, dict]:
            other = asyncio.create_task(stream_other())
            result = await long_prompt()
            await other
            return result

        sent, first_token, final = asyncio.run(both())
    finally:
        server.stop()
    during_prefill = [t for t in stream_times if sent < t < first_token]
    assert len(during_prefill) >= 3000 // 256 - 2  # a token per chunk step, give or take
    assert_same_or_tie(model_path, long_ids, greedy(model_path, long_ids, 8), final["output_ids"])


def test_overlap_schedule_gives_the_same_greedy_output(default_server: RunningServer,
                                                       tmp_path: Path, model_path: str) -> None:
    bodies = [{"text": f"Note {i}: " + words(4 + 9 * i, seed=200 + i),
               "sampling_params": {"max_new_tokens": 12 + 2 * i, "temperature": 0,
                                   "ignore_eos": True}} for i in range(12)]
    bodies.append({"text": "The alphabet: A, B, C,", "sampling_params": {
        "max_new_tokens": 40, "temperature": 0, "stop": [" G"]}})

    async def run(base_url: str) -> list[dict]:
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as c:
            async def one(body: dict) -> dict:
                r = await c.post("/generate", json=body)
                assert r.status_code == 200, r.text
                return r.json()
            return list(await asyncio.gather(*(one(b) for b in bodies)))

    normal = asyncio.run(run(default_server.base_url))
    assert "scheduling with the overlap loop" not in default_server.log()  # not on CPU
    server = start_server(tmp_path, "--enable-overlap-schedule", "--max-total-tokens", "8192")
    try:
        overlapped = asyncio.run(run(server.base_url))
        with httpx.Client(base_url=server.base_url) as client:
            info = pool(client)
        assert "scheduling with the overlap loop" in server.log()
    finally:
        server.stop()
    assert info["num_free_slots"] + info["num_cached_slots"] == info["num_total_slots"]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    for body, want, got in zip(bodies, normal, overlapped):
        assert_same_or_tie(model_path, tokenizer.encode(body["text"]), want["output_ids"],
                           got["output_ids"])
    assert overlapped[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert overlapped[-1]["text"] == normal[-1]["text"]
