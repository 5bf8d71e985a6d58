"""`--cpu-kernels torch` (plain torch everywhere) against the default `auto` (shoal's CPU
kernels) on the served default model: the same greedy token ids, each equal to transformers'
(a near tie in transformers' own logits aside). Set through the environment (`SHOAL_CPU_KERNELS`),
so the flag's env fallback is exercised too; the server's log says the kernels were ruled out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from tests.support.generate import PROMPTS, greedy_outputs
from tests.support.reference import assert_same_or_tie, greedy
from tests.support.server import RunningServer, start_server

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def torch_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(Path(tmp_path_factory.mktemp("torch-kernels")),
                          env={"SHOAL_CPU_KERNELS": "torch"})
    yield server
    server.stop()


def test_torch_and_kernels_give_the_same_greedy_ids(
        default_server: RunningServer, torch_server: RunningServer, model_path: str,
        tokenizer: PreTrainedTokenizerBase) -> None:
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    with_kernels = greedy_outputs(default_server.base_url, prompts, NEW_TOKENS)
    plain = greedy_outputs(torch_server.base_url, prompts, NEW_TOKENS)
    assert "--cpu-kernels torch: plain torch everywhere" in torch_server.log()
    for ids, kernels_out, torch_out in zip(prompts, with_kernels, plain):
        expected = greedy(model_path, ids, NEW_TOKENS)
        assert_same_or_tie(model_path, ids, expected, torch_out)
        assert_same_or_tie(model_path, ids, expected, kernels_out)
        assert_same_or_tie(model_path, ids, torch_out, kernels_out)
