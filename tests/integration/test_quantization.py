"""Weight-only int8 (`--quantization w8a16`) against float32 on the default model (issue 12's
acceptance 3): greedy outputs agree for at least 90% of the tokens over the parity prompts (each
token is the one float32 picks after the same prefix), the mean absolute logprob difference on
the first 32 tokens is reported, and the perplexity of a small text stays within 2% of
float32's."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from shoal.engine.model_runner import ModelRunner
from shoal.models.forward_batch import ForwardBatch
from shoal.models.parallel import ParallelGroup
from tests.support.generate import PROMPTS, greedy_outputs
from tests.support.server import RunningServer, start_server

NEW_TOKENS = 64
LOGPROB_TOKENS = 32
MIN_AGREEMENT = 0.9
MAX_PERPLEXITY_RATIO = 1.02
# A small English text (written for this test), for perplexity.
TEXT = (
    "The river runs through the middle of the old town, under seven stone bridges. In the "
    "morning the market opens on the east bank, where farmers sell bread, cheese, apples and "
    "fresh fish from the coast. Children walk to school along the water, and the church bell "
    "rings at eight o'clock. In the afternoon the streets are quiet. Most people work in the "
    "shops, the library or the small hospital near the station. When the summer comes, "
    "visitors arrive by train to see the castle on the hill and to swim in the lake behind "
    "it. The town has a museum with paintings, old maps and a famous clock that has told the "
    "time for three hundred years. In winter the river sometimes freezes, and everyone goes "
    "out to skate on the ice until the sun sets behind the mountains."
)


@pytest.fixture(scope="module")
def runners(model_path: str) -> dict[str, ModelRunner]:
    return {q: ModelRunner(model_path, torch.device("cpu"), torch.float32, ParallelGroup(),
                           max_total_tokens=1024, max_running_requests=1, context_length=512,
                           quantization=q)
            for q in ("none", "w8a16")}


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(Path(tmp_path_factory.mktemp("int8-server")),
                          "--quantization", "w8a16", "--max-total-tokens", "16384")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def float_greedy(default_server: RunningServer, prompts: list[list[int]]) -> list[list[int]]:
    return greedy_outputs(default_server.base_url, prompts, NEW_TOKENS)


@torch.inference_mode()
def next_token_logprobs(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log-probabilities of the token after each position, in one prefill."""
    n = len(ids)
    row = runner.req_to_token_pool.alloc()
    slots = runner.token_allocator.alloc(n)
    assert row is not None and slots is not None
    try:
        runner.req_to_token_pool.table[row, :n] = slots
        logits = runner.forward(ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.arange(n), out_cache_loc=slots,
            req_pool_indices=torch.tensor([row]), seq_lens=torch.tensor([n]), extend_lens=[n],
            logit_indices=torch.arange(n)))
    finally:
        runner.token_allocator.free(slots)
        runner.req_to_token_pool.free(row)
    assert isinstance(logits, torch.Tensor)
    return torch.log_softmax(logits, dim=-1)


def test_w8a16_greedy_outputs_agree_with_float32(int8_server: RunningServer,
                                                 runners: dict[str, ModelRunner],
                                                 prompts: list[list[int]],
                                                 float_greedy: list[list[int]]) -> None:
    """Each token the int8 server emits is, in at least 90% of the positions, the token float32
    picks after the same prefix. (Free-running sequences are reported, not held to 90%: after
    the first near-tie that breaks the other way, a 135M model's continuations part for good.)"""
    int8_out = greedy_outputs(int8_server.base_url, prompts, NEW_TOKENS)
    agree = 0
    for prompt, out in zip(prompts, int8_out):
        ids = prompt + out
        float_choice = next_token_logprobs(runners["none"], ids)[len(prompt) - 1:-1].argmax(-1)
        agree += int((float_choice == torch.tensor(out)).sum())
    agreement = agree / (len(prompts) * NEW_TOKENS)
    same = sum(a == b for f, q in zip(float_greedy, int8_out) for a, b in zip(f, q))
    print(f"w8a16 served greedy tokens that are float32's greedy choice: {agreement:.3f}; "
          f"free-running sequences equal position by position: "
          f"{same / (len(prompts) * NEW_TOKENS):.3f}")
    assert agreement >= MIN_AGREEMENT


def test_w8a16_logprobs_and_perplexity_stay_close(runners: dict[str, ModelRunner],
                                                  prompts: list[list[int]],
                                                  float_greedy: list[list[int]],
                                                  tokenizer: PreTrainedTokenizerBase) -> None:
    diffs, agree, total = [], 0, 0
    for prompt, continuation in zip(prompts, float_greedy):
        # both models scored on float32's greedy continuation (teacher forcing)
        ids = prompt + continuation[:LOGPROB_TOKENS]
        float_lp = next_token_logprobs(runners["none"], ids)
        int8_lp = next_token_logprobs(runners["w8a16"], ids)
        start = len(ids) - LOGPROB_TOKENS - 1
        chosen = torch.tensor(ids[start + 1:])
        positions = torch.arange(start, len(ids) - 1)
        diffs.append((float_lp[positions, chosen] - int8_lp[positions, chosen]).abs())
        agree += int((int8_lp[positions].argmax(-1) == chosen).sum())
        total += LOGPROB_TOKENS
    mean_diff = float(torch.cat(diffs).mean())
    print(f"w8a16 vs float32: mean |logprob difference| over the first {LOGPROB_TOKENS} tokens "
          f"{mean_diff:.4f}; teacher-forced argmax agreement {agree / total:.3f}")
    assert agree / total >= MIN_AGREEMENT
    assert mean_diff < 0.1

    text = tokenizer.encode(TEXT)
    ppl = {}
    for name, runner in runners.items():
        lp = next_token_logprobs(runner, text)[:-1]
        ppl[name] = math.exp(-float(lp.gather(1, torch.tensor(text[1:])[:, None]).mean()))
    print(f"perplexity of {len(text)} tokens: float32 {ppl['none']:.3f}, "
          f"w8a16 {ppl['w8a16']:.3f} ({ppl['w8a16'] / ppl['none']:.4f}x)")
    assert ppl["w8a16"] <= MAX_PERPLEXITY_RATIO * ppl["none"]
