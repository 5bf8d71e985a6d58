"""Acceptance: greedy output of the served default model equals transformers token for token."""

from __future__ import annotations

import asyncio

import httpx
from transformers import AutoTokenizer

from tests.support.reference import assert_same_or_tie, greedy
from tests.support.server import RunningServer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "Translate to French: I like apples.",
    "The three primary colors are",
    "Q: What is photosynthesis?\nA:",
    "import numpy as np\nx = np.",
    "Les fleurs du jardin sont",
]
NEW_TOKENS = 64


async def _generate_all(base_url: str, prompts: list[list[int]]) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        async def one(ids: list[int]) -> list[int]:
            r = await client.post("/generate", json={
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                    "ignore_eos": True}})
            r.raise_for_status()
            return r.json()["output_ids"]
        return list(await asyncio.gather(*(one(p) for p in prompts)))


def test_greedy_parity_with_transformers(default_server: RunningServer, model_path: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    served = asyncio.run(_generate_all(default_server.base_url, prompts))
    for ids, out in zip(prompts, served):
        assert len(out) == NEW_TOKENS
        assert_same_or_tie(model_path, ids, greedy(model_path, ids, NEW_TOKENS), out)
