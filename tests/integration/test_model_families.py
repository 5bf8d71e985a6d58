"""Acceptance for the model families: a tiny random-weight checkpoint of each (built with
transformers' own class, saved sharded, in bf16 / fp16 for some) is served by `shoal serve`,
and its greedy tokens and their logprobs equal transformers' in float32.

One server per family and flag set, module-scoped; every prompt goes in one batch.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import PreTrainedTokenizerBase

from shoal.lifecycle import ExitCode
from tests.support import tiny_models
from tests.support.generate import PROMPTS
from tests.support.server import STARTUP_TIMEOUT_S, RunningServer, start_server

NEW_TOKENS = 32
TIE_GAP = 1e-4  # greedy ids may part only where transformers' top-2 logprob gap is below this
LOGPROB_TOLERANCE = 1e-3
# each family's server with the flags of its run: the kernels on (auto) and off; tp 2 for the MoE
# family and a dense one
RUNS = [(family, flags) for family in tiny_models.SERVED
        for flags in ((), ("--cpu-kernels", "torch"))] + [
    ("qwen2-moe", ("--tp", "2")), ("gemma2", ("--tp", "2"))]


@dataclass(frozen=True)
class Reference:
    tokens: list[int]
    logprobs: list[float]
    gaps: list[float]  # top-2 logprob gap before each token


@dataclass(frozen=True)
class Served:
    tokens: list[int]
    logprobs: list[float]
    cached_tokens: int


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: tiny_models.build(family, root / family, Path(model_path))
            for family in tiny_models.SERVED}


@pytest.fixture(scope="module")
def prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS[:8]]


def _run_id(run: tuple[str, tuple[str, ...]]) -> str:
    family, flags = run
    return "-".join([family, *(flag.lstrip("-") for flag in flags)])


@pytest.fixture(scope="module", params=RUNS, ids=_run_id)
def served(request: pytest.FixtureRequest, checkpoints: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, RunningServer]]:
    family, flags = request.param
    server = start_server(tmp_path_factory.mktemp(family), "--model-path",
                          str(checkpoints[family]), "--max-total-tokens", "4096", *flags)
    yield family, server
    server.stop()


@torch.inference_mode()
def reference(path: Path, prompt: list[int], new_tokens: int) -> Reference:
    """transformers' greedy continuation in float32 (EOS does not stop it), with each token's
    logprob and the top-2 logprob gap at each step."""
    from tests.support.reference import reference_model

    model = reference_model(str(path))
    out = model(torch.tensor([prompt]), use_cache=True)
    result = Reference([], [], [])
    for _ in range(new_tokens):
        logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        top = logprobs.topk(2)
        token = int(top.indices[0])
        result.tokens.append(token)
        result.logprobs.append(float(top.values[0]))
        result.gaps.append(float(top.values[0] - top.values[1]))
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return result


def serve(base_url: str, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[Served]:
    """Every prompt's greedy continuation with logprobs, from native /generate, all at once."""

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            async def one(ids: list[int]) -> dict[str, Any]:
                r = await client.post("/generate", json={
                    "input_ids": ids, "return_logprob": True, "sampling_params": {
                        "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}})
                r.raise_for_status()
                return dict(r.json())
            return list(await asyncio.gather(*(one(p) for p in prompts)))

    return [Served(body["output_ids"],
                   [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]],
                   body["meta_info"]["cached_tokens"]) for body in asyncio.run(run())]


def assert_matches(expected: Reference, got: Served) -> None:
    """Token for token equal, logprobs within LOGPROB_TOLERANCE, up to a first difference that
    only a reference near-tie (gap below TIE_GAP) excuses."""
    assert len(got.tokens) == len(expected.tokens)
    for step, (mine, theirs) in enumerate(zip(got.tokens, expected.tokens)):
        if mine != theirs:
            assert expected.gaps[step] < TIE_GAP, (
                f"token {step} differs ({mine} vs {theirs}) with a top-2 gap of "
                f"{expected.gaps[step]:.2e}:\nserved    {got.tokens}\nreference {expected.tokens}")
            return
        assert abs(got.logprobs[step] - expected.logprobs[step]) < LOGPROB_TOLERANCE, (
            f"token {step} logprob {got.logprobs[step]} vs {expected.logprobs[step]}")


def test_greedy_tokens_and_logprobs_match_transformers(
        served: tuple[str, RunningServer], checkpoints: dict[str, Path],
        prompts: list[list[int]]) -> None:
    family, server = served
    for prompt, got in zip(prompts, serve(server.base_url, prompts)):
        assert_matches(reference(checkpoints[family], prompt, NEW_TOKENS), got)


@pytest.mark.parametrize("served", [("gemma2", ()), ("gemma3", ())], indirect=True,
                         ids=["gemma2", "gemma3"])
def test_a_prefix_past_the_sliding_window_is_served_from_the_radix_cache(
        served: tuple[str, RunningServer], checkpoints: dict[str, Path],
        tokenizer: PreTrainedTokenizerBase) -> None:
    """Gemma's alternating window and global layers: a prompt five windows long, then another
    sharing all but its last tokens; the second reuses the first's K/V and still attends only
    within each window layer's window."""
    family, server = served
    shared = tokenizer.encode("A harbour at dawn: gulls, ropes, nets and the smell of salt. " * 3)
    assert len(shared) > 4 * tiny_models.SLIDING_WINDOW
    first, second = shared + tokenizer.encode(" The boats"), shared + tokenizer.encode(" Far")
    for prompt, expect_cached in ((first, False), (second, True)):
        [got] = serve(server.base_url, [prompt])
        assert (got.cached_tokens >= len(shared) - 1) == expect_cached, got.cached_tokens
        assert_matches(reference(checkpoints[family], prompt, NEW_TOKENS), got)


@pytest.mark.parametrize(("change", "named"), [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config"),
    ({"architectures": ["FalconForCausalLM"]}, "FalconForCausalLM"),
], ids=["quantized", "unknown-architecture"])
def test_what_shoal_does_not_implement_stops_the_server_naming_it(
        checkpoints: dict[str, Path], tmp_path: Path, change: dict[str, Any], named: str
        ) -> None:
    folder = tmp_path / "model"
    shutil.copytree(checkpoints["mistral"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    server = start_server(tmp_path, "--model-path", str(folder), wait=False)
    try:
        code = server.proc.wait(timeout=STARTUP_TIMEOUT_S)
    finally:
        server.stop()
    assert code == ExitCode.STARTUP_FAILED and named in server.log(), server.log()
