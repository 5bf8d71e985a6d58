"""The checkpoint's generation_config.json sets the sampling a request leaves out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.api.protocol import ChatCompletionRequest, GenerateRequest
from shoal.api.responses_protocol import ResponsesRequest
from shoal.lifecycle import StartupFailed
from shoal.tokenizer import OPENAI_DEFAULTS, SamplingDefaults, sampling_defaults


def _model(tmp_path: Path, generation: dict[str, object] | None) -> str:
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return str(tmp_path)


def test_the_checkpoints_defaults_fill_what_a_request_leaves_out(tmp_path: Path) -> None:
    defaults = sampling_defaults(_model(tmp_path, {
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
        "eos_token_id": [1, 2]}))
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0)
    messages = [{"role": "user", "content": "hi"}]
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": messages,
                                                 "temperature": 0.0}).to_sampling(8, defaults)
    assert (chat.temperature, chat.top_p, chat.top_k) == (0.0, 0.95, 20)
    native = GenerateRequest.model_validate({"text": "hi", "sampling_params": {"top_k": 5}})
    sampling = native.sampling_params.to_sampling(8, defaults)
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.6, 0.95, 5)
    responses = ResponsesRequest.model_validate({"model": "m", "input": "hi", "top_p": 0.5})
    sampling = responses.to_sampling(8, defaults)
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.6, 0.5, 20)


def test_without_a_generation_config_openais_defaults_hold(tmp_path: Path) -> None:
    assert sampling_defaults(_model(tmp_path, None)) == OPENAI_DEFAULTS
    assert sampling_defaults(_model(tmp_path, {"eos_token_id": 2})) == OPENAI_DEFAULTS


def test_an_impossible_default_stops_the_server_naming_it(tmp_path: Path) -> None:
    with pytest.raises(StartupFailed, match="top_p"):
        sampling_defaults(_model(tmp_path, {"top_p": 0.0}))
