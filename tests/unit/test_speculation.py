"""Speculative decoding (prompt lookup): the proposal and acceptance rules as pure functions, and
the scheduler verifying proposals with the counting model (next token = input token + 1)."""

from __future__ import annotations

import logging
import random
import re
import time

import pytest
import torch
import xgrammar as xgr

from shoal.config import ConfigError, ServerArgs
from shoal.ipc.messages import LogprobParams, SamplingParams
from shoal.metrics.scheduler_metrics import SchedulerStats
from shoal.scheduler.speculation import (
    NgramProposer,
    accept_greedy,
    accept_sampled,
    grammar_masked,
    grammar_prefix,
)
from tests.support.scheduler import (
    EOS,
    VOCAB,
    LetterTokenizer,
    letter_grammars,
    make_scheduler,
    request,
    run_until_idle,
)

SPEC = NgramProposer(num_draft_tokens=4)
# counts 1..20 twice, then 1..3: the counting model continues 4, 5, ..., which the first two
# copies propose
REPETITIVE = [*range(1, 21), *range(1, 21), 1, 2, 3]


def random_prompt(seed: int, n: int = 60) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


# -- proposal ------------------------------------------------------------------------------------

def test_proposal_continues_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    # "7 8" occurs twice before the end; the latest is followed by 4 5
    assert SPEC.propose([7, 8, 1, 2, 7, 8, 4, 5, 6, 7, 8], limit=3) == [4, 5, 6]
    # a longer match wins over a later, shorter one
    assert SPEC.propose([1, 2, 3, 9, 8, 3, 7, 1, 2, 3], limit=2) == [9, 8]
    # no bigram match: the unigram 9's latest occurrence
    assert SPEC.propose([9, 1, 9, 2, 3, 9], limit=2) == [2, 3]
    assert SPEC.propose([1, 2, 3, 4], limit=4) == []
    assert SPEC.propose([1, 2, 1, 2], limit=0) == []
    assert NgramProposer(num_draft_tokens=2).propose([1, 2, 3, 4, 1, 2], limit=9) == [3, 4]
    # the continuation may run into the suffix itself
    assert SPEC.propose([5, 5, 5], limit=4) == [5]


# -- acceptance ----------------------------------------------------------------------------------

def test_greedy_acceptance_keeps_the_matching_prefix_and_the_targets_next_token() -> None:
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accept_greedy([4, 5, 6], [8, 5, 6, 7]) == [8]


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_sampled_acceptance_is_distributed_as_the_target() -> None:
    """Each yielded token is distributed as the target's row for its position: the first by
    row 0, the second (after the first proposal was kept) by row 1, the third by row 2."""
    probs = torch.tensor([[0.1, 0.5, 0.2, 0.2, 0.0],
                          [0.6, 0.05, 0.05, 0.2, 0.1],
                          [0.25, 0.25, 0.25, 0.0, 0.25]])
    proposal = [1, 3]  # kept with probability 0.5, then 0.2
    generator = torch.Generator().manual_seed(1234)
    firsts, seconds, thirds = (torch.zeros(5) for _ in range(3))
    trials = 40_000
    for _ in range(trials):
        out = accept_sampled(proposal, probs, generator)
        assert 1 <= len(out) <= 3 and out[:-1] == proposal[:len(out) - 1]
        firsts[out[0]] += 1
        if out[0] == proposal[0]:
            seconds[out[1]] += 1
            if out[1] == proposal[1]:
                thirds[out[2]] += 1
    # standard error of a frequency is <= 0.5 / sqrt(n); the bounds are several of those
    assert _tv(firsts, probs[0]) < 0.015
    assert _tv(seconds, probs[1]) < 0.02
    assert _tv(thirds, probs[2]) < 0.05
    assert firsts[4] == 0 and thirds[3] == 0  # zero-probability tokens never come out
    # a proposal the target rules out is always rejected, one it is sure of always kept
    sure = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert accept_sampled([1], sure, generator) == [1, 2]
    assert accept_sampled([0], sure, generator) == [1]


# -- the scheduler -------------------------------------------------------------------------------

def _run(prompt: list[int], spec: NgramProposer | None, radix: bool = True,
         **params: object) -> tuple[list[int], object]:
    scheduler, io, model = make_scheduler(speculation=spec, radix=radix)
    io.inbox.append(request("a", prompt, **params))  # type: ignore[arg-type]
    run_until_idle(scheduler)
    assert scheduler.memory.check_idle_integrity()
    return io.tokens("a"), scheduler


@pytest.mark.parametrize("radix", [True, False])
def test_greedy_output_is_the_same_with_and_without_speculation(radix: bool) -> None:
    plain, _ = _run(REPETITIVE, None, radix=radix, max_new=16)
    tokens, scheduler = _run(REPETITIVE, SPEC, radix=radix, max_new=16)
    assert tokens == plain == list(range(4, 20))
    # every proposal was accepted: a prefill, then 5 tokens per forward
    assert scheduler.num_forward_steps == 4  # type: ignore[attr-defined]
    assert scheduler.num_verify_steps == 3  # type: ignore[attr-defined]
    assert scheduler.num_generated_tokens == 16  # type: ignore[attr-defined]


@pytest.mark.parametrize("seed", range(5))
def test_greedy_output_is_the_same_on_random_text(seed: int) -> None:
    prompt = random_prompt(seed)
    plain, _ = _run(prompt, None, max_new=40)
    tokens, scheduler = _run(prompt, SPEC, max_new=40)
    assert tokens == plain
    assert scheduler.num_verify_steps > 0  # type: ignore[attr-defined]


def test_stop_tokens_and_context_length_end_a_verified_step_where_they_would() -> None:
    for params in ({"stop_token_ids": [9]}, {"max_new": 5}):
        plain, _ = _run(REPETITIVE, None, **({"max_new": 30} | params))
        tokens, _ = _run(REPETITIVE, SPEC, **({"max_new": 30} | params))
        assert tokens == plain and len(tokens) <= 6
    scheduler, io, _ = make_scheduler(context=50, speculation=SPEC)
    io.inbox.append(request("a", REPETITIVE, max_new=30))
    run_until_idle(scheduler)
    assert len(REPETITIVE) + len(io.tokens("a")) == 50 and io.finish("a").kind == "length"
    assert scheduler.memory.check_idle_integrity()


def test_rejected_proposals_never_reach_the_prefix_cache() -> None:
    """On random text most proposals are rejected; what the cache holds afterwards is exactly
    the request's prompt and output (all but the last token, never computed), and a request
    continuing that text is served from it with the same output."""
    prompt = random_prompt(7)
    tokens, scheduler = _run(prompt, SPEC, max_new=40)
    assert scheduler.num_verified_tokens < 2 * scheduler.num_verify_steps  # type: ignore[attr-defined]
    text = prompt + tokens
    cache = scheduler.memory.cache  # type: ignore[attr-defined]
    assert cache.total_size == len(text) - 1
    assert len(cache.match(text).slots) == len(text) - 1
    io = scheduler.io  # type: ignore[attr-defined]
    io.inbox.append(request("b", text[:50] + [1, 2, 3], max_new=10))
    io.inbox.append(request("c", text, max_new=10))
    run_until_idle(scheduler)  # type: ignore[arg-type]
    assert io.tokens("c") == _run(text, None, max_new=10)[0]
    assert io.tokens("b") == _run(text[:50] + [1, 2, 3], None, max_new=10)[0]
    assert scheduler.memory.check_idle_integrity()  # type: ignore[attr-defined]


def test_many_requests_under_a_small_pool_keep_outputs_and_leak_nothing() -> None:
    prompts = [REPETITIVE, random_prompt(1), REPETITIVE[5:], random_prompt(2, 30)]
    expected = [_run(p, None, max_new=25)[0] for p in prompts]
    scheduler, io, _ = make_scheduler(num_slots=160, speculation=SPEC)
    io.inbox += [request(str(i), p, max_new=25) for i, p in enumerate(prompts)]
    run_until_idle(scheduler)
    assert [io.tokens(str(i)) for i in range(len(prompts))] == expected
    assert scheduler.memory.check_idle_integrity()


def test_a_request_that_opts_out_or_asks_for_logprobs_does_not_speculate() -> None:
    for params in ({"speculative": False}, {"logprob": LogprobParams(top_logprobs_num=0)},
                   {"repetition_penalty": 1.1}):
        tokens, scheduler = _run(REPETITIVE, SPEC, max_new=10, **params)
        assert scheduler.num_verify_steps == 0, params  # type: ignore[attr-defined]
        assert len(tokens) == 10


def _run_constrained(prompt: list[int], spec: NgramProposer | None,
                     **params: object) -> tuple[list[int], object]:
    scheduler, io, _ = make_scheduler(speculation=spec)
    scheduler.grammars = letter_grammars()
    io.inbox.append(request("a", prompt, **params))  # type: ignore[arg-type]
    run_until_idle(scheduler)
    assert scheduler.memory.check_idle_integrity()
    assert io.finish("a") is not None
    return io.tokens("a"), scheduler


@pytest.mark.parametrize(("regex", "accepting"), [
    ("[a-z]{14}", True),  # every letter allowed: the copied count is proposed and kept
    ("[e-m]{3}[a-z]{8}", True),  # the proposals that leave the grammar are cut before verify
    ("[b-d]{9}", False),  # the grammar overrides the model: proposals cut to nothing or rejected
])
def test_structured_outputs_speculate_with_the_same_output(regex: str, accepting: bool) -> None:
    """A grammar masks each verified position as its state after the proposals before it, and
    only accepted tokens reach it: the output is the same as without speculation, and ends
    where the grammar does."""
    plain, _ = _run_constrained(REPETITIVE, None, max_new=30, regex=regex)
    tokens, scheduler = _run_constrained(REPETITIVE, SPEC, max_new=30, regex=regex)
    assert tokens == plain and tokens[-1] == EOS
    assert re.fullmatch(regex, LetterTokenizer().decode(tokens[:-1]))
    steps = scheduler.num_verify_steps  # type: ignore[attr-defined]
    if accepting:
        assert steps > 0 and scheduler.num_verified_tokens / steps > 2  # type: ignore[attr-defined]


def test_grammar_prefix_and_masks_leave_the_matcher_where_it_was() -> None:
    grammars = letter_grammars()
    matcher = grammars.matcher(SamplingParams(regex="[b-e]{3}"))
    assert matcher is not None

    def mask() -> list[int]:
        bitmask = xgr.allocate_token_bitmask(1, VOCAB)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bitmask.tolist()

    before = mask()
    # z is outside [b-e]; a fourth letter is past the end; EOS would end the grammar, which
    # is the target's own choice to make
    assert grammar_prefix(matcher, [1, 2, 25, 3]) == [1, 2]
    assert grammar_prefix(matcher, [1, 2, 3, 4]) == [1, 2, 3]
    assert grammar_prefix(matcher, [1, 2, 3, EOS]) == [1, 2, 3]
    assert mask() == before
    logits = torch.zeros(3, VOCAB)
    masked = grammar_masked(logits, matcher, [1, 2])
    assert mask() == before
    allowed = [set(torch.nonzero(row > -1e30).flatten().tolist()) for row in masked]
    assert allowed[0] == allowed[1] == allowed[2] == {1, 2, 3, 4, 27, 28, 29, 30}


def test_sampled_requests_speculate_with_the_targets_distribution() -> None:
    """At a low temperature the counting model's one-hot logits leave (almost) no choice: the
    output counts on, and proposals are kept."""
    tokens, scheduler = _run(REPETITIVE, SPEC, max_new=20, temperature=0.02, seed=3)
    assert tokens == list(range(4, 24))
    assert scheduler.num_verified_tokens / scheduler.num_verify_steps > 3  # type: ignore[attr-defined]


def test_speculation_flags() -> None:
    assert ServerArgs(speculative_algorithm="NGRAM").speculation == "ngram"
    assert ServerArgs().speculation is None
    with pytest.raises(ConfigError, match="draft"):
        ServerArgs(speculative_algorithm="draft")
    with pytest.raises(ConfigError, match="--speculative-algorithm"):
        ServerArgs(speculative_algorithm="eagle")
    with pytest.raises(ConfigError, match="--tp"):
        ServerArgs(speculative_algorithm="ngram", tp=2)
    with pytest.raises(ConfigError, match="--speculative-num-draft-tokens"):
        ServerArgs(speculative_algorithm="ngram", speculative_num_draft_tokens=0)
    assert not ServerArgs(speculative_algorithm="ngram").use_overlap_schedule("cuda")
    assert ServerArgs(speculative_algorithm="ngram", disaggregation_mode="decode").speculation
    with pytest.raises(ConfigError, match="decode servers"):
        ServerArgs(speculative_algorithm="ngram", disaggregation_mode="prefill")


def test_a_step_that_scores_prompt_positions_verifies_nothing() -> None:
    """A batch returns one set of logits rows: a step that collects prompt logprobs leaves the
    decoding requests' proposals out; both requests' outputs stay exact."""
    scheduler, io, model = make_scheduler(speculation=SPEC)
    io.inbox.append(request("a", REPETITIVE, max_new=16))
    scheduler.step()
    scheduler.step()
    io.inbox.append(request("b", [30, 31, 32], max_new=4,
                            logprob=LogprobParams(logprob_start_len=0)))
    scheduler.step()
    assert model.batches[-1].extend_lens == [1, 3]
    run_until_idle(scheduler)
    assert io.tokens("a") == list(range(4, 20)) and io.tokens("b") == [33, 34, 35, 36]
    assert scheduler.memory.check_idle_integrity()


def test_the_log_line_reports_the_accept_length(caplog: pytest.LogCaptureFixture) -> None:
    scheduler, io, _ = make_scheduler(speculation=SPEC)
    io.inbox.append(request("a", REPETITIVE, max_new=16))
    run_until_idle(scheduler)
    stats = SchedulerStats(enable_metrics=False)
    with caplog.at_level(logging.INFO):
        stats.report(scheduler.snapshot(), time.monotonic())
    assert "accept len: 5.00" in caplog.text  # 15 tokens in 3 verify steps
