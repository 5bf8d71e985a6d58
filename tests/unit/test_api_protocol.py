"""Pure tests of the api's request models and length rules (no server, no tokenizer)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shoal.api.errors import APIError
from shoal.api.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatStreamChoice,
    CompletionRequest,
    DeltaMessage,
    GenerateRequest,
    Usage,
)
from shoal.api.tokenizer_manager import fit_max_new_tokens
from shoal.ipc.messages import LogprobParams, SamplingParams

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("prompt_len, requested, default, context, expected", [
    (10, None, None, 100, 90),      # OpenAI: no max_tokens → everything left
    (10, None, 128, 100, 90),       # native default clipped to the room left
    (10, None, 16, 100, 16),
    (10, 90, None, 100, 90),        # exactly fits
    (10, 5, None, None, 5),         # no context known yet
    (10, None, None, None, 128),
])
def test_fit_max_new_tokens(prompt_len, requested, default, context, expected):
    assert fit_max_new_tokens(prompt_len, requested, default, context) == expected


@pytest.mark.parametrize("prompt_len, requested, fragment", [
    (100, None, "is longer than the model's context length"),
    (150, 1, "is longer than the model's context length"),
    (10, 91, "exceeds the model's maximum context length"),
])
def test_fit_max_new_tokens_rejects(prompt_len, requested, fragment):
    with pytest.raises(APIError) as info:
        fit_max_new_tokens(prompt_len, requested, None, 100)
    assert info.value.status_code == 400 and fragment in info.value.message


def test_chat_request_to_sampling():
    req = ChatCompletionRequest.model_validate({
        "messages": USER, "temperature": 0, "top_p": 0.5, "top_k": 20, "min_p": 0.1,
        "stop": "\n", "seed": 7, "ignore_eos": True, "stop_token_ids": [5],
        "skip_special_tokens": False, "max_completion_tokens": 9})
    assert req.requested_max_tokens == 9
    sampling = req.to_sampling(9)
    assert sampling == SamplingParams(max_new_tokens=9, temperature=0.0, top_p=0.5, top_k=20,
                                      min_p=0.1, seed=7, stop=["\n"], stop_token_ids=[5],
                                      ignore_eos=True, skip_special_tokens=False)
    assert sampling.is_greedy


def test_chat_template_options():
    assert ChatCompletionRequest.model_validate({"messages": USER}).template_options == {
        "add_generation_prompt": True, "continue_final_message": False}
    continued = [*USER, {"role": "assistant", "content": "Once upon"}]
    req = ChatCompletionRequest.model_validate({
        "messages": continued, "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert req.template_options == {"enable_thinking": False, "add_generation_prompt": False,
                                    "continue_final_message": True}
    with pytest.raises(ValidationError, match="cannot go with"):
        ChatCompletionRequest.model_validate({"messages": continued, "add_generation_prompt": True,
                                              "continue_final_message": True})


def test_temperature_range_is_openai_s_on_openai_routes_only():
    chat = ChatCompletionRequest.model_validate({"messages": USER, "temperature": 2})
    assert chat.temperature == 2
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "temperature": 5})
    assert GenerateRequest.model_validate(
        {"text": "x", "sampling_params": {"temperature": 5}}).sampling_params.temperature == 5


def test_defaults_are_openai_defaults():
    sampling = ChatCompletionRequest.model_validate({"messages": USER}).to_sampling(4)
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (1, 1, -1, 0)
    assert sampling.stop == [] and not sampling.ignore_eos


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", "5"), ("max_tokens", 2.5),
    ("temperature", -0.1), ("temperature", 2.01), ("top_p", 0), ("top_p", 1.01), ("top_k", -2),
    ("min_p", 2),
    ("n", 0), ("n", 9), ("stop", ["a", "b", "c", "d", "e"]), ("stop", [""]), ("stop", 3),
    ("seed", 2**63), ("stream", "yes"), ("logprobs", "yes"), ("top_logprobs", 21),
    ("top_logprobs", 3),  # without logprobs: true
    ("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("repetition_penalty", 0),
    ("repetition_penalty", 2.5), ("min_tokens", -1), ("logit_bias", {"x": 1}),
    ("logit_bias", {"5": 101}), ("logit_bias", {"-5": 1}), ("logit_bias", [5]),
    ("messages", []), ("messages", [{"role": "wizard", "content": "x"}]),
    ("continue_final_message", True),  # the last message is the user's
    ("chat_template_kwargs", {"add_generation_prompt": False}),
    ("chat_template_kwargs", {"tools": []}),
])
def test_chat_request_rejects(field, value):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": USER, field: value})


def test_completion_prompt_forms():
    def prompts(prompt):
        return CompletionRequest.model_validate({"prompt": prompt}).prompts

    assert prompts("a") == ["a"] and prompts([1, 2]) == [[1, 2]] and prompts([]) == [[]]
    assert prompts(["a"]) == ["a"] and prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[3, 4]]) == [[3, 4]] and prompts([[3], [4, 5]]) == [[3], [4, 5]]
    for bad in [5, None, [1.5], ["a", 1], [[1], "a"], ["a"] * 257]:
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": bad})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({})


def test_native_request_allows_many_stops_and_defaults():
    req = GenerateRequest.model_validate(
        {"text": "x", "sampling_params": {"stop": ["a", "b", "c", "d", "e"], "top_k": 0}})
    assert req.sampling_params.max_new_tokens is None
    assert req.sampling_params.to_sampling(3).top_k == -1
    assert GenerateRequest.model_validate({"input_ids": [1]}).sampling_params.temperature is None


def test_chunk_delta_omits_unset_fields():
    chunk = ChatCompletionChunk(id="c", created=0, model="m", choices=[
        ChatStreamChoice(delta=DeltaMessage(content="hi"))])
    body = chunk.model_dump()
    assert body["choices"][0]["delta"] == {"content": "hi"}
    assert body["choices"][0]["finish_reason"] is None


def test_usage_totals():
    usage = Usage.of(7, 3, 2)
    assert usage.total_tokens == 10 and usage.prompt_tokens_details.cached_tokens == 2


def test_sampling_extensions_to_sampling():
    req = ChatCompletionRequest.model_validate({
        "messages": USER, "n": 3, "frequency_penalty": 0.5, "presence_penalty": -1,
        "repetition_penalty": 1.3, "min_tokens": 4, "logit_bias": {"17": -100, "5": 2.5},
        "logprobs": True, "top_logprobs": 2})
    sampling = req.to_sampling(10)
    assert (sampling.frequency_penalty, sampling.presence_penalty,
            sampling.repetition_penalty) == (0.5, -1.0, 1.3)
    assert sampling.min_new_tokens == 4 and sampling.logit_bias == {17: -100.0, 5: 2.5}
    assert sampling.processes_logits and req.n == 3 and req.logit_bias_ids == [17, 5]
    assert req.logprob_params() == LogprobParams(top_logprobs_num=2)
    assert ChatCompletionRequest.model_validate({"messages": USER}).logprob_params() is None
    # min_tokens beyond what fits is clipped to max_new_tokens
    assert req.to_sampling(2).min_new_tokens == 2


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "a", "max_tokens": 3, "min_tokens": 4})
    with pytest.raises(ValidationError):
        GenerateRequest.model_validate({"text": "a", "sampling_params": {
            "max_new_tokens": 3, "min_new_tokens": 4}})


def test_completion_logprob_params():
    def params(**body):
        return CompletionRequest.model_validate({"prompt": "a", **body}).logprob_params()

    assert params() is None and params(echo=True) is None
    assert params(logprobs=0) == LogprobParams(top_logprobs_num=0, logprob_start_len=-1)
    assert params(logprobs=5, echo=True) == LogprobParams(top_logprobs_num=5, logprob_start_len=0)
    with pytest.raises(ValidationError):
        params(logprobs=21)


def test_native_logprob_and_penalty_params():
    req = GenerateRequest.model_validate({
        "text": "x", "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 2,
        "sampling_params": {"min_new_tokens": 2, "repetition_penalty": 1.1,
                            "logit_bias": {"9": 1}}})
    assert req.logprob_params() == LogprobParams(top_logprobs_num=3, logprob_start_len=2)
    sampling = req.sampling_params.to_sampling(8)
    assert sampling.min_new_tokens == 2 and sampling.repetition_penalty == 1.1
    assert sampling.logit_bias == {9: 1.0}
    assert GenerateRequest.model_validate({"text": "x"}).logprob_params() is None
    assert not GenerateRequest.model_validate({"text": "x"}).sampling_params.to_sampling(
        8).processes_logits
