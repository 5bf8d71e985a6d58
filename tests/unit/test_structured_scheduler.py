"""Structured outputs in the scheduler, on CPU with the counting model: the grammar masks each
step's sampling, advances with each processed token and ends the request; requests beside a
constrained one are unaffected; both loops, sampling, retraction; constraints that do not
compile are refused."""

from __future__ import annotations

import re

import msgspec
import pytest
import torch
import xgrammar as xgr

from shoal.engine.sampler import apply_grammar_masks
from shoal.ipc.messages import GenerateReq, SamplingParams
from shoal.scheduler import admission
from tests.support.scheduler import (
    EOS,
    VOCAB,
    LetterTokenizer,
    letter_grammars,
    make_scheduler,
    request,
    run_overlapped_until_idle,
    run_until_idle,
)

LETTERS = LetterTokenizer()


def grammar_scheduler(**kwargs: object):
    scheduler, io, model = make_scheduler(**kwargs)  # type: ignore[arg-type]
    scheduler.grammars = letter_grammars()
    return scheduler, io, model


def counting(last: int, n: int) -> list[int]:
    """What the counting model generates after `last`, unconstrained."""
    out = []
    for _ in range(n):
        last = last % (VOCAB - 1) + 1
        out.append(last)
    return out


def sampled(req: GenerateReq) -> GenerateReq:
    return msgspec.structs.replace(req, sampling=msgspec.structs.replace(req.sampling,
                                                                         temperature=1.0))


def text(ids: list[int]) -> str:
    return LETTERS.decode([i for i in ids if i != EOS])


@pytest.mark.parametrize("overlap", [False, True])
def test_regex_masks_greedy_decoding_and_ends_the_request(overlap: bool) -> None:
    scheduler, io, _ = grammar_scheduler()
    io.inbox += [request("c", [10], max_new=20, regex="[b-d]{5}"),
                 request("u", [5], max_new=12)]
    (run_overlapped_until_idle(scheduler, io) if overlap else run_until_idle(scheduler))
    # the counting model wants 11 ('l'); the mask leaves b, c, d: the first allowed id wins,
    # then the model's own next letter while allowed; once five letters exist only EOS is left
    assert io.tokens("c") == [1, 2, 3, 1, 2, EOS]
    assert io.finish("c").kind == "stop"
    assert io.tokens("u") == counting(5, 12)
    assert scheduler.memory.check_idle_integrity()


def test_grammar_ends_a_request_that_ignores_eos() -> None:
    scheduler, io, _ = grammar_scheduler()
    io.inbox.append(request("c", [10], max_new=20, ignore_eos=True, ebnf='root ::= "bcd"'))
    run_until_idle(scheduler)
    assert io.tokens("c") == [1, 2, 3, EOS]
    assert io.finish("c").matched_token == EOS


def test_sampling_keeps_to_the_grammar_in_both_loops_under_retraction(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "RESERVE_CLIP", 2)  # overcommit, so decode retracts
    pattern = "(ab|cde){8,}f"
    for overlap in (False, True):
        scheduler, io, _ = grammar_scheduler(num_slots=150, max_running=16, chunk=16)
        io.inbox += [sampled(request(f"c{i}", [i + 1] * 10, max_new=40, regex=pattern, seed=i))
                     for i in range(6)]
        io.inbox += [request(f"u{i}", [i + 1] * 10, max_new=40) for i in range(4)]
        (run_overlapped_until_idle(scheduler, io) if overlap else run_until_idle(scheduler))
        assert scheduler.num_retracted > 0
        for i in range(6):
            tokens = io.tokens(f"c{i}")
            if io.finish(f"c{i}").kind == "stop":
                assert re.fullmatch(pattern, text(tokens)), tokens
            else:  # cut by max_new: still a prefix of a match
                assert re.fullmatch("(ab|cde)*(a|cd?)?", text(tokens)), tokens
        for i in range(4):
            assert io.tokens(f"u{i}") == counting(i + 1, 40)
        assert scheduler.memory.check_idle_integrity()


@pytest.mark.parametrize("params, problem", [
    ({"regex": "(ab"}, "does not compile"),
    ({"json_schema": '{"type": "foo"}'}, "does not compile"),
])
def test_a_constraint_that_does_not_compile_aborts(params: dict, problem: str) -> None:
    scheduler, io, _ = grammar_scheduler()
    io.inbox.append(request("bad", [3], **params))
    scheduler.step()
    finish = io.finish("bad")
    assert finish.kind == "abort" and finish.refused and problem in finish.message
    assert not scheduler.has_work


def test_without_grammars_a_constrained_request_is_refused() -> None:
    scheduler, io, _ = make_scheduler()
    io.inbox.append(request("c", [3], regex="a+"))
    scheduler.step()
    finish = io.finish("c")
    assert finish.kind == "abort" and finish.refused and "not served" in finish.message


class MaskedRow:
    def __init__(self, grammar: xgr.GrammarMatcher | None) -> None:
        self.grammar = grammar


def test_masks_apply_only_to_constrained_rows_and_leave_the_input() -> None:
    grammars = letter_grammars()
    matcher = grammars.matcher(SamplingParams(regex="[xy]"))
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    masked = apply_grammar_masks(logits, [MaskedRow(None), MaskedRow(matcher)])  # type: ignore[list-item]
    assert torch.equal(logits, before) and torch.equal(masked[0], before[0])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert {LETTERS.decode([i]) for i in allowed} == {"x", "y"}
    assert apply_grammar_masks(logits, [MaskedRow(None)] * 2) is logits  # type: ignore[list-item]
    assert grammars.matcher(SamplingParams()) is None
