"""Acceptance (issue 17): a batch of prompts on /v1/completions, sent by the official client to
the served default model. Choice i is sample i % n of prompt i // n, each greedy choice is what
the prompt gives alone, and usage adds up over the batch."""

from __future__ import annotations

import pytest
from openai import OpenAI
from openai.types import Completion
from transformers import PreTrainedTokenizerBase

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far"]
N = 2
MAX_TOKENS = 8
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_name(openai_client: OpenAI) -> str:
    return openai_client.models.list().data[0].id


@pytest.fixture(scope="module")
def alone(openai_client: OpenAI, model_name: str) -> list[Completion]:
    """Each prompt sent on its own."""
    return [openai_client.completions.create(model=model_name, prompt=p, **GREEDY)
            for p in PROMPTS]


def batch_prompt(tokenizer: PreTrainedTokenizerBase, as_ids: bool) -> list[str] | list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS] if as_ids else PROMPTS


@pytest.mark.parametrize("as_ids", [False, True], ids=["strings", "token_arrays"])
def test_batch(openai_client: OpenAI, model_name: str, tokenizer: PreTrainedTokenizerBase,
               alone: list[Completion], as_ids: bool) -> None:
    r = openai_client.completions.create(model=model_name, prompt=batch_prompt(tokenizer, as_ids),
                                         n=N, **GREEDY)
    assert [c.index for c in r.choices] == list(range(len(PROMPTS) * N))
    assert [c.text for c in r.choices] == [alone[i // N].choices[0].text
                                           for i in range(len(PROMPTS) * N)]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == len(PROMPTS) * N * MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("as_ids", [False, True], ids=["strings", "token_arrays"])
def test_batch_stream(openai_client: OpenAI, model_name: str, tokenizer: PreTrainedTokenizerBase,
                      alone: list[Completion], as_ids: bool) -> None:
    chunks = list(openai_client.completions.create(
        model=model_name, prompt=batch_prompt(tokenizer, as_ids), n=N, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    count = len(PROMPTS) * N
    texts, finishes = [""] * count, [[] for _ in range(count)]
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert texts == [alone[i // N].choices[0].text for i in range(count)]
    assert finishes == [["length"]] * count
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert last.usage.completion_tokens == count * MAX_TOKENS
