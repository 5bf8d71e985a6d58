"""Acceptance: greedy output of the served default model equals transformers token for token."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from tests.support.generate import PROMPTS, greedy_outputs
from tests.support.reference import assert_same_or_tie, greedy
from tests.support.server import RunningServer

NEW_TOKENS = 64


def test_greedy_parity_with_transformers(default_server: RunningServer, model_path: str,
                                         tokenizer: PreTrainedTokenizerBase) -> None:
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    served = greedy_outputs(default_server.base_url, prompts, NEW_TOKENS)
    for ids, out in zip(prompts, served):
        assert len(out) == NEW_TOKENS
        assert_same_or_tie(model_path, ids, greedy(model_path, ids, NEW_TOKENS), out)
