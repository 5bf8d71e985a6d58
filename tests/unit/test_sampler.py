"""The sampler on fixed logits: each parameter against a reference computation.

References: transformers' logits processors where they define the same thing (repetition penalty,
top-k, top-p, min-p), otherwise the formula written out per token in plain Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from shoal.engine import penalties, sampler
from shoal.engine.penalties import PenaltyState
from shoal.engine.sampler import PromptSlice, SamplingWork
from shoal.ipc.messages import (
    LogprobParams,
    SamplingParams,
    SamplingResult,
    decode_sampling_result,
    encode_sampling_result,
)

VOCAB = 32
EOS = 2


@dataclass
class Row:
    """A request as sampling sees it (the scheduler's Req has the same fields)."""

    sampling: SamplingParams
    input_ids: list[int] = field(default_factory=lambda: [3, 4, 5, 4])
    output_ids: list[int] = field(default_factory=list)
    logprob: LogprobParams | None = None
    generator: torch.Generator | None = None
    penalties: PenaltyState | None = None
    grammar: None = None

    def __post_init__(self) -> None:
        self.generator = sampler.make_generator(self.sampling)
        self.penalties = penalties.make_state(self.sampling, self.input_ids, {EOS})


def fixed_logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=generator) * 3


def processed(row: Row, logits: torch.Tensor) -> torch.Tensor:
    return penalties.apply(logits.unsqueeze(0), [row])[0]


# ---- logit processing ---------------------------------------------------------------------------


def test_plain_requests_cost_nothing():
    logits = fixed_logits(3)
    rows = [Row(SamplingParams(temperature=0.0)) for _ in range(3)]
    assert all(r.penalties is None for r in rows)
    assert penalties.apply(logits, rows) is logits  # no copy, no work
    assert sampler.sample(logits, rows) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    row = Row(SamplingParams(repetition_penalty=penalty), output_ids=[7, 7, 9])
    logits = fixed_logits()[0]
    seen = torch.tensor([row.input_ids + row.output_ids])
    expected = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits.unsqueeze(0).clone())[0]
    torch.testing.assert_close(processed(row, logits), expected)


def test_frequency_and_presence_penalties_are_openai_formula():
    row = Row(SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
              input_ids=[1, 1, 12], output_ids=[7, 7, 7, 9, 30])
    logits = fixed_logits()[0]
    out = processed(row, logits)
    for token in range(VOCAB):
        count = row.output_ids.count(token)  # the prompt does not count (OpenAI)
        want = logits[token].item() - 0.7 * count - (-0.4) * (count > 0)
        assert out[token].item() == pytest.approx(want, abs=1e-5)


def test_penalty_order_repetition_then_frequency_presence_then_bias():
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias={7: 3.0, 0: -1.0})
    row = Row(params, input_ids=[4], output_ids=[7, 7])
    logits = fixed_logits()[0]
    out = processed(row, logits)
    for token in range(VOCAB):
        x = logits[token].item()
        if token in (4, 7):
            x = x / 1.5 if x > 0 else x * 1.5
        count = row.output_ids.count(token)
        x -= 0.5 * count + 0.25 * (count > 0)
        x += params.logit_bias.get(token, 0.0)
        assert out[token].item() == pytest.approx(x, abs=1e-5)


def test_counts_catch_up_with_new_output():
    row = Row(SamplingParams(frequency_penalty=1.0))
    logits = fixed_logits()[0]
    assert torch.equal(processed(row, logits), logits)
    row.output_ids += [5, 5]
    assert processed(row, logits)[5].item() == pytest.approx(logits[5].item() - 2.0)
    row.output_ids.append(5)
    assert processed(row, logits)[5].item() == pytest.approx(logits[5].item() - 3.0)


def test_batched_penalties_equal_one_at_a_time():
    rows = [Row(SamplingParams(temperature=0.0)),
            Row(SamplingParams(frequency_penalty=0.3), output_ids=[1, 2, 2]),
            Row(SamplingParams(repetition_penalty=1.2, presence_penalty=1.0), output_ids=[8]),
            Row(SamplingParams(temperature=0.0)),
            Row(SamplingParams(repetition_penalty=0.8, logit_bias={3: 5.0}), output_ids=[3])]
    logits = fixed_logits(len(rows), seed=1)
    batched = penalties.apply(logits, rows)
    for i, row in enumerate(rows):
        alone = penalties.apply(logits[i:i + 1], [row])[0]
        torch.testing.assert_close(batched[i], alone)
    assert not torch.equal(batched, logits) and torch.equal(logits, fixed_logits(5, seed=1))


def test_logit_bias_forces_a_token():
    logits = fixed_logits()
    row = Row(SamplingParams(temperature=0.0, logit_bias={11: 100.0}))
    assert sampler.sample(logits, [row]) == [11]
    row = Row(SamplingParams(temperature=0.0, logit_bias={int(logits.argmax()): -100.0}))
    assert sampler.sample(logits, [row]) == [int(logits[0].topk(2).indices[1])]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_stop_tokens_until_reached(ignore_eos):
    params = SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[9],
                            ignore_eos=ignore_eos, logit_bias={EOS: 50.0, 9: 40.0})
    row = Row(params)
    logits = fixed_logits()
    first = processed(row, logits[0])
    assert first[9].item() == float("-inf")
    assert (first[EOS].item() == float("-inf")) != ignore_eos  # EOS is a stop unless ignored
    row.output_ids = [4]
    assert processed(row, logits[0])[9].item() == float("-inf")
    row.output_ids = [4, 4]
    assert sampler.sample(logits, [row]) == [EOS]  # masks lifted: the bias wins


# ---- top-k / top-p / min-p ----------------------------------------------------------------------


def reference_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                           min_p: float) -> list[float]:
    """The same filters written out token by token: rank by probability; keep rank < top_k, keep
    while the mass before a token is < top_p, keep p >= min_p * p_max; renormalize."""
    scaled = [x / temperature for x in logits.tolist()]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    keep, mass = set(), 0.0
    for rank, token in enumerate(order):
        if ((top_k <= 0 or rank < top_k) and mass < top_p
                and probs[token] >= min_p * probs[order[0]]):
            keep.add(token)
        mass += probs[token]
    kept = sum(probs[t] for t in keep)
    return [probs[t] / kept if t in keep else 0.0 for t in range(len(probs))]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, -1, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.0, -1, 0.6, 0.0), (1.3, -1, 1.0, 0.2),
    (0.9, 8, 0.8, 0.05), (2.0, 3, 0.99, 0.5),
])
def test_filters_match_reference(temperature, top_k, top_p, min_p):
    logits = fixed_logits(seed=3)[0]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    got = sampler.token_distribution(logits, params)
    want = reference_distribution(logits, temperature, top_k, top_p, min_p)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("warper, params", [
    (TopKLogitsWarper(6), SamplingParams(top_k=6)),
    (TopPLogitsWarper(0.7), SamplingParams(top_p=0.7)),
    (MinPLogitsWarper(0.1), SamplingParams(min_p=0.1)),
])
def test_single_filters_match_transformers(warper, params):
    logits = fixed_logits(seed=4)
    want = torch.softmax(warper(torch.tensor([[0]]), logits.clone()), dim=-1)[0]
    torch.testing.assert_close(sampler.token_distribution(logits[0], params), want)


def test_samples_follow_the_distribution():
    logits = fixed_logits(seed=5)
    params = SamplingParams(temperature=0.8, top_k=6, seed=1)
    row = Row(params)
    draws = [sampler.sample(logits, [row])[0] for _ in range(2000)]
    expected = sampler.token_distribution(logits[0], params)
    for token in range(VOCAB):
        assert draws.count(token) / len(draws) == pytest.approx(expected[token].item(), abs=0.04)


def test_seeded_requests_reproduce_in_any_batch():
    logits = fixed_logits(4, seed=6)

    def run(order: list[int], seed: int) -> list[int]:
        rows = {i: Row(SamplingParams(temperature=1.0, seed=seed + i)) for i in order}
        draws: dict[int, list[int]] = {i: [] for i in order}
        for _ in range(20):
            tokens = sampler.sample(logits[order], [rows[i] for i in order])
            for i, token in zip(order, tokens):
                draws[i].append(token)
        return [t for i in sorted(order) for t in draws[i]]

    assert run([0, 1, 2, 3], seed=10) == run([3, 1, 0, 2], seed=10)
    assert run([0, 1, 2, 3], seed=10) != run([0, 1, 2, 3], seed=20)


# ---- logprobs -----------------------------------------------------------------------------------


def test_logprobs_are_of_raw_logits():
    logits = fixed_logits(3, seed=7)
    rows = [Row(SamplingParams(temperature=0.0, frequency_penalty=1.5), output_ids=[1, 1],
                logprob=LogprobParams(top_logprobs_num=3)),
            Row(SamplingParams(temperature=0.5, seed=3)),
            Row(SamplingParams(temperature=2.0, seed=4, logit_bias={0: 10.0}),
                logprob=LogprobParams())]
    work = SamplingWork(rows, [2, 0, 1],
                        prompt=[PromptSlice(row=0, target_ids=[5, 6], top_n=2)])
    result = sampler.run(logits, work)
    raw = torch.log_softmax(logits, dim=-1)
    first, second, third = result.logprobs
    assert second is None
    assert first.logprobs == pytest.approx([raw[2, result.tokens[0]].item()], abs=1e-6)
    assert first.top_ids == [raw[2].topk(3).indices.tolist()]
    assert first.top_logprobs[0] == pytest.approx(raw[2].topk(3).values.tolist(), abs=1e-6)
    assert third.logprobs == pytest.approx([raw[1, result.tokens[2]].item()], abs=1e-6)
    assert third.top_ids == []
    (prompt,) = result.prompt_logprobs
    assert prompt.logprobs == pytest.approx([raw[0, 5].item(), raw[1, 6].item()], abs=1e-6)
    assert prompt.top_ids == [raw[0].topk(2).indices.tolist(), raw[1].topk(2).indices.tolist()]
    assert decode_sampling_result(encode_sampling_result(result)) == result


def test_work_without_logprobs_returns_tokens_only():
    logits = fixed_logits(2)
    result = sampler.run(logits, SamplingWork([Row(SamplingParams(temperature=0.0))], [1]))
    assert result == SamplingResult(tokens=[int(logits[1].argmax())])
