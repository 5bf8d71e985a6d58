"""Regressions (issue 15's fuzzer): sampling values at the edge of float32 sample the
distribution's limit, the argmax, instead of crashing the scheduler (`temperature: 1e-320`:
"probability tensor contains either `inf`, `nan` or element < 0"; `top_p: 5e-324`: "invalid
multinomial distribution")."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from shoal.engine import sampler
from shoal.engine.penalties import PenaltyState
from shoal.ipc.messages import LogprobParams, SamplingParams


@dataclass
class Row:
    sampling: SamplingParams
    generator: torch.Generator | None = None
    output_ids: tuple[int, ...] = ()
    penalties: PenaltyState | None = None
    logprob: LogprobParams | None = None
    grammar: None = None


@pytest.mark.parametrize("temperature", [1e-320, 1e-45, 1e-38])
def test_a_vanishing_temperature_samples_the_argmax(temperature: float) -> None:
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(max_new_tokens=4, temperature=temperature, seed=3)
    rows = [Row(params, sampler.make_generator(params)) for _ in range(2)]
    assert sampler.sample(logits, rows) == logits.argmax(dim=-1).tolist()


def test_an_infinite_logit_is_sampled() -> None:
    logits = torch.randn(500, generator=torch.Generator().manual_seed(2))
    logits[123] = float("inf")
    probs = sampler.token_distribution(logits, SamplingParams(max_new_tokens=4, temperature=1.0))
    assert torch.isfinite(probs).all() and probs[123] == 1.0


@pytest.mark.parametrize("top_p", [5e-324, 1e-45])
def test_a_vanishing_top_p_keeps_the_top_token(top_p: float) -> None:
    """Regression: `top_p: 5e-324` (0 in float32) dropped every token, and the scheduler crashed
    on "invalid multinomial distribution (sum of probabilities <= 0)"."""
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=top_p, seed=5)
    rows = [Row(params, sampler.make_generator(params)) for _ in range(2)]
    assert sampler.sample(logits, rows) == logits.argmax(dim=-1).tolist()
