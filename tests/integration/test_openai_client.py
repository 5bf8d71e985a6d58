"""Acceptance: the official openai client against the served default model."""

from __future__ import annotations

import pytest
from openai import BadRequestError, OpenAI
from transformers import PreTrainedTokenizerBase

MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]
ALPHABET = "The alphabet: A, B, C, D, E,"


@pytest.fixture(scope="module")
def model_name(openai_client: OpenAI) -> str:
    models = openai_client.models.list().data
    assert len(models) == 1
    return models[0].id


def chat_prompt_tokens(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> int:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)
    return len(encoded["input_ids"])


def test_chat_usage_and_length_finish(openai_client: OpenAI, model_name: str,
                                      tokenizer: PreTrainedTokenizerBase) -> None:
    r = openai_client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=12,
                                              temperature=0, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant" and choice.message.content
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == chat_prompt_tokens(tokenizer, MESSAGES)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_stops_at_eos(openai_client: OpenAI, model_name: str) -> None:
    r = openai_client.chat.completions.create(
               model=model_name, messages=[{"role": "user", "content": "Say hello."}],
               max_tokens=200, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 200
    assert "<|im_end|>" not in r.choices[0].message.content


def test_chat_streaming_matches_non_streaming(openai_client: OpenAI, model_name: str) -> None:
    full = openai_client.chat.completions.create(model=model_name, messages=MESSAGES,
                                                 max_tokens=30, temperature=0)
    stream = openai_client.chat.completions.create(model=model_name, messages=MESSAGES,
                                                   max_tokens=30, temperature=0, stream=True,
                                                   stream_options={"include_usage": True})
    chunks = list(stream)
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in content_chunks if c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == full.choices[0].message.content
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and not usage_chunks[0].choices
    assert usage_chunks[0].usage.completion_tokens == full.usage.completion_tokens
    assert usage_chunks[0].usage.prompt_tokens == full.usage.prompt_tokens


def test_stop_strings_are_honored_and_trimmed(openai_client: OpenAI, model_name: str) -> None:
    base = openai_client.completions.create(model=model_name, prompt=ALPHABET, max_tokens=24,
                                            temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[6:9]
    assert len(stop.strip()) > 0
    expected = text[:text.index(stop)]
    for stream in (False, True):
        r = openai_client.completions.create(model=model_name, prompt=ALPHABET,
                                             max_tokens=24, temperature=0, stop=[stop, "zzzz"],
                                             stream=stream)
        if stream:
            parts = list(r)
            got = "".join(p.choices[0].text for p in parts if p.choices)
            reasons = [p.choices[0].finish_reason for p in parts
                       if p.choices and p.choices[0].finish_reason]
        else:
            got, reasons = r.choices[0].text, [r.choices[0].finish_reason]
        assert got == expected
        assert reasons == ["stop"]


def test_seed_reproduces_sampling(openai_client: OpenAI, model_name: str) -> None:
    def sample(seed: int) -> str:
        r = openai_client.chat.completions.create(model=model_name, messages=MESSAGES,
                                                  max_tokens=24, temperature=1.0, seed=seed)
        return r.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2)}) > 1


def test_completions_streaming_and_usage(openai_client: OpenAI, model_name: str,
                                         tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = "The capital of Italy is"
    full = openai_client.completions.create(model=model_name, prompt=prompt, max_tokens=8,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert full.usage.completion_tokens == 8 and full.choices[0].finish_reason == "length"
    parts = list(openai_client.completions.create(model=model_name, prompt=prompt, max_tokens=8,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True}))
    text = "".join(p.choices[0].text for p in parts if p.choices)
    assert text == full.choices[0].text
    finishes = [p.choices[0].finish_reason for p in parts
                if p.choices and p.choices[0].finish_reason]
    assert finishes == ["length"]
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 8


def test_model_listing(openai_client: OpenAI, model_name: str) -> None:
    assert openai_client.models.retrieve(model_name).id == model_name


def test_model_length_from_the_config(openai_client: OpenAI, model_name: str,
                                      model_path: str) -> None:
    from shoal.model_config import ModelConfig

    (card,) = openai_client.models.list().data
    assert card.model_extra["max_model_len"] == \
        ModelConfig.from_pretrained(model_path).max_position_embeddings


def test_responses_create_and_stream(openai_client: OpenAI, model_name: str) -> None:
    kwargs = {"model": model_name, "input": "Say hello.", "instructions": "Be brief.",
              "max_output_tokens": 10, "temperature": 0}
    r = openai_client.responses.create(**kwargs)
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.output_tokens <= 10
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = list(openai_client.responses.create(stream=True, **kwargs))
    assert events[0].type == "response.created"
    assert events[-1].type == f"response.{r.status}"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == r.output_text


def test_responses_bad_request(openai_client: OpenAI, model_name: str) -> None:
    with pytest.raises(BadRequestError) as info:
        openai_client.responses.create(model=model_name, input="hi", max_output_tokens=0)
    assert info.value.body["param"] == "max_output_tokens"
    assert info.value.body["type"] == "invalid_request_error"
