"""Acceptance: logprobs and sampling parameters of the served default model against transformers.

Logprobs must equal `log_softmax` of transformers' float32 logits within 1e-4; penalties must give
the greedy tokens of transformers' logits with the same penalty math applied step by step.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from openai import OpenAI
from transformers import PreTrainedTokenizerBase

from tests.support.reference import reference_model
from tests.support.server import RunningServer

TOLERANCE = 1e-4
PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def model(openai_client: OpenAI) -> str:
    return openai_client.models.list().data[0].id


@pytest.fixture(scope="module")
def http(default_server: RunningServer) -> httpx.Client:
    with httpx.Client(base_url=default_server.base_url, timeout=120) as http_client:
        yield http_client


@torch.inference_mode()
def reference_logprobs(model_path: str, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of `ids` [len, vocab]."""
    logits = reference_model(model_path)(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def generate(http: httpx.Client, body: dict) -> dict:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_native_logprobs_match_transformers(http: httpx.Client, model_path: str,
                                            tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = tokenizer.encode(PROMPT)
    out = generate(http, {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 5,
                          "logprob_start_len": 0, "sampling_params": {
                              "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
    meta, output = out["meta_info"], out["output_ids"]
    ref = reference_logprobs(model_path, prompt + output)
    served_prompt = meta["input_token_logprobs"]
    assert [t[1] for t in served_prompt] == prompt and served_prompt[0][0] is None
    for i, (value, token, _) in enumerate(served_prompt[1:], start=1):
        assert abs(value - ref[i - 1, token].item()) < TOLERANCE
    for k, (value, token, _) in enumerate(meta["output_token_logprobs"]):
        position = len(prompt) - 1 + k
        assert token == output[k] and abs(value - ref[position, token].item()) < TOLERANCE
        top = meta["output_top_logprobs"][k]
        ref_top = ref[position].topk(5)
        assert [t[1] for t in top][:2] == ref_top.indices.tolist()[:2]  # lower ranks may tie
        assert [t[0] for t in top] == pytest.approx(ref_top.values.tolist(), abs=TOLERANCE)


def test_completion_logprobs_with_echo_match_transformers(openai_client: OpenAI, model: str,
                                                          http: httpx.Client, model_path: str,
                                                          tokenizer: PreTrainedTokenizerBase
                                                          ) -> None:
    prompt = tokenizer.encode(PROMPT)
    output = generate(http, {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})["output_ids"]
    ref = reference_logprobs(model_path, prompt + output)
    r = openai_client.completions.create(prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                         logprobs=3, model=model, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    ids = prompt + output
    assert r.choices[0].text.startswith(PROMPT) and len(lp.tokens) == len(ids)
    assert lp.tokens == [tokenizer.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < TOLERANCE
        # the 3 most likely tokens, and the token itself where it is not among them
        assert lp.tokens[i] in lp.top_logprobs[i] and len(lp.top_logprobs[i]) <= 4
        assert lp.top_logprobs[i][lp.tokens[i]] == pytest.approx(lp.token_logprobs[i], abs=1e-5)
        assert max(lp.top_logprobs[i].values()) == pytest.approx(ref[i - 1].max().item(),
                                                                 abs=TOLERANCE)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_top_logprobs(openai_client: OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Name a color."}]
    r = openai_client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                              temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content)
    for token in content:
        assert len(token.top_logprobs) == 3
        values = [t.logprob for t in token.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert token.logprob == pytest.approx(values[0], abs=1e-6)  # greedy took the top one
        assert token.top_logprobs[0].token == token.token


def test_n_choices(openai_client: OpenAI, model: str) -> None:
    kwargs = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 5,
              "extra_body": {"ignore_eos": True}}
    r = openai_client.completions.create(n=3, **kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1  # each choice has its own seed
    single = openai_client.completions.create(n=1, **kwargs)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens
    assert r.usage.completion_tokens == 18 and r.choices[0].text == single.choices[0].text
    chunks = list(openai_client.completions.create(
        n=3, stream=True, stream_options={"include_usage": True}, **kwargs))
    texts = {i: "" for i in range(3)}
    finishes = {i: 0 for i in range(3)}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] += choice.finish_reason is not None
    assert texts == {c.index: c.text for c in r.choices}  # seeded: streaming reproduces
    assert finishes == {0: 1, 1: 1, 2: 1}
    assert chunks[-1].usage.completion_tokens == 18 and chunks[-1].choices == []


def test_min_tokens_holds_eos_back(openai_client: OpenAI, model: str,
                                   tokenizer: PreTrainedTokenizerBase) -> None:
    eos = tokenizer.eos_token_id
    r = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0,
                                         logit_bias={str(eos): 100},
                                         extra_body={"min_tokens": 5, "ignore_eos": False})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 6  # five tokens, then the EOS the bias forces


def test_logit_bias_forces_a_token(openai_client: OpenAI, model: str,
                                   tokenizer: PreTrainedTokenizerBase) -> None:
    (banana,) = tokenizer.encode(" banana")
    r = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                         logit_bias={str(banana): 100})
    assert r.choices[0].text == " banana" * 4


def penalize(logits: torch.Tensor, prompt: list[int], output: list[int], frequency: float,
             presence: float, repetition: float) -> torch.Tensor:
    """The penalty math written out: repetition over prompt + output, then OpenAI's frequency and
    presence over the output."""
    logits = logits.clone()
    seen = torch.tensor(sorted(set(prompt + output)))
    picked = logits[seen]
    logits[seen] = torch.where(picked > 0, picked / repetition, picked * repetition)
    for token in set(output):
        logits[token] -= frequency * output.count(token) + presence
    return logits


@pytest.mark.parametrize("frequency, presence, repetition", [
    (1.0, 0.0, 1.0), (0.0, 1.5, 1.0), (0.0, 0.0, 1.5), (0.5, 0.5, 1.2)])
def test_penalties_match_reference(http: httpx.Client, model_path: str,
                                   tokenizer: PreTrainedTokenizerBase, frequency: float,
                                   presence: float, repetition: float) -> None:
    """Each served token is transformers' greedy choice after the penalties, given the tokens
    before it (one teacher-forced forward: the same as stepping while they agree)."""
    prompt = tokenizer.encode("apple apple apple apple apple apple")
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = generate(http, {"input_ids": prompt, "sampling_params": params})["output_ids"]
    served = generate(http, {"input_ids": prompt, "sampling_params": {
        **params, "frequency_penalty": frequency, "presence_penalty": presence,
        "repetition_penalty": repetition}})["output_ids"]
    assert served != plain
    with torch.inference_mode():
        logits = reference_model(model_path)(torch.tensor([prompt + served])).logits[0].float()
    for k, token in enumerate(served):
        penalized = penalize(logits[len(prompt) - 1 + k], prompt, served[:k], frequency,
                             presence, repetition)
        best = int(penalized.argmax())
        assert token == best or penalized[best] - penalized[token] < 1e-3, (
            f"step {k}: served {token}, reference {best}")
