"""Requests the acceptance tests send to a real server: the greedy prompt set and the chat check."""

from __future__ import annotations

import asyncio

import httpx

# greedy prompts whose continuations are compared: server vs transformers, TP/PP vs one rank
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
    "My favourite season is",
]


def greedy_outputs(base_url: str, prompts: list[list[int]], max_new_tokens: int
                   ) -> list[list[int]]:
    """Each prompt's greedy continuation of exactly `max_new_tokens` (EOS does not stop it),
    from native /generate, all requests at once."""

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
            async def one(ids: list[int]) -> list[int]:
                r = await client.post("/generate", json={"input_ids": ids, "sampling_params": {
                    "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}})
                r.raise_for_status()
                return r.json()["output_ids"]
            return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(run())


def ask_capital_of_france(base_url: str, max_tokens: int = 40) -> str:
    """The chat answer to "What is the capital of France?" (greedy); the caller looks for Paris."""
    r = httpx.post(base_url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]
