"""Acceptance: 32 concurrent streams of mixed lengths each equal the same request served alone."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
from transformers import AutoTokenizer

from tests.support.reference import assert_same_or_tie
from tests.support.server import RunningServer

NUM_REQUESTS = 32
WORDS = ["river", "stone", "light", "garden", "music", "winter", "paper", "city", "window",
         "forest", "number", "ocean", "story", "bridge", "market", "cloud", "engine"]


def make_requests(seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    requests = []
    for i in range(NUM_REQUESTS):
        prompt = f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))
        requests.append({"text": prompt, "stream": True,
                         "sampling_params": {"max_new_tokens": rng.randint(4, 48),
                                             "temperature": 0, "ignore_eos": True}})
    return requests


async def stream_one(client: httpx.AsyncClient, body: dict) -> list[int]:
    output_ids: list[int] = []
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            output_ids = chunk["output_ids"]
    return output_ids


async def run_all(base_url: str, bodies: list[dict], concurrent: bool) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        if concurrent:
            return list(await asyncio.gather(*(stream_one(client, b) for b in bodies)))
        return [await stream_one(client, b) for b in bodies]


def test_concurrent_streams_equal_solo_runs(default_server: RunningServer,
                                            model_path: str) -> None:
    bodies = make_requests()
    together = asyncio.run(run_all(default_server.base_url, bodies, concurrent=True))
    alone = asyncio.run(run_all(default_server.base_url, bodies, concurrent=False))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    for body, got, solo in zip(bodies, together, alone):
        assert len(got) == body["sampling_params"]["max_new_tokens"]
        assert_same_or_tie(model_path, tokenizer.encode(body["text"]), solo, got)
