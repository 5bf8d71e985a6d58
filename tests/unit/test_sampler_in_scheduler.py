"""Sampling features through the scheduler on CPU with a fake model: prompt logprobs across
chunks and prefix-cache hits, output logprobs, penalties, min_new_tokens with stop strings."""

from __future__ import annotations

import pytest
import torch

from shoal.detokenizer.incremental import cut_at_stop
from shoal.ipc.messages import GenerateReq, LogprobParams, SamplingParams
from shoal.models.forward_batch import ForwardBatch
from shoal.scheduler.request import Req
from shoal.scheduler.stop import StopChecker
from tests.support.scheduler import (
    EOS,
    VOCAB,
    LetterTokenizer,
    make_scheduler,
    request,
    run_until_idle,
)


class TableModel:
    """The logits after token t are row t of a fixed random table, at every position asked."""

    def __init__(self) -> None:
        self.table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
        self.batches: list[ForwardBatch] = []

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.batches.append(batch)
        return self.table[batch.input_ids[batch.logits_at]]

    def logprob(self, prev: int, token: int) -> float:
        return torch.log_softmax(self.table[prev], dim=-1)[token].item()

    def greedy(self, last: int, n: int) -> list[int]:
        out = []
        for _ in range(n):
            last = int(self.table[last].argmax())
            out.append(last)
        return out


def scheduler_with_table(chunk: int = 2048):  # type: ignore[no-untyped-def]
    scheduler, io, _ = make_scheduler(chunk=chunk)
    model = scheduler.runner = TableModel()
    return scheduler, io, model


def run_to_max(rid: str, prompt: list[int], max_new: int = 4, **params: object) -> GenerateReq:
    """A greedy request that EOS does not stop."""
    return request(rid, prompt, max_new=max_new, ignore_eos=True, **params)


PROMPT = [3, 17, 8, 22, 5, 40, 11, 9, 30, 2, 14]


def test_prompt_and_output_logprobs_across_chunks():
    scheduler, io, model = scheduler_with_table(chunk=4)
    io.inbox.append(run_to_max("a", PROMPT, logprob=LogprobParams(top_logprobs_num=2,
                                                           logprob_start_len=0)))
    io.inbox.append(run_to_max("b", [7, 7, 7, 7, 7, 7], max_new=3))  # shares the steps, no logprobs
    run_until_idle(scheduler)
    outs = [o for o in io.outputs if o.rid == "a"]
    prompt_lp = outs[0].prompt_logprobs
    assert prompt_lp is not None and all(o.prompt_logprobs is None for o in outs[1:])
    want = [model.logprob(PROMPT[i], PROMPT[i + 1]) for i in range(len(PROMPT) - 1)]
    assert prompt_lp.logprobs == [pytest_approx(w) for w in want]
    top = torch.log_softmax(model.table[PROMPT[0]], -1).topk(2)
    assert prompt_lp.top_ids[0] == top.indices.tolist()
    tokens = io.tokens("a")
    assert tokens == model.greedy(PROMPT[-1], 4)
    output_lp = [v for o in outs for v in o.logprobs.logprobs]
    prev = [PROMPT[-1]] + tokens[:-1]
    assert output_lp == [pytest_approx(model.logprob(p, t)) for p, t in zip(prev, tokens)]
    assert io.tokens("b") == model.greedy(7, 3)
    # extra logits only in the steps that computed a's prompt
    extra = [b.logit_indices is not None for b in model.batches]
    assert extra[:3] == [True] * 3 and not any(extra[3:])
    assert scheduler.memory.check_idle_integrity()


def test_prompt_logprobs_are_not_served_from_the_prefix_cache():
    scheduler, io, model = scheduler_with_table()
    io.inbox.append(run_to_max("warm", PROMPT))
    run_until_idle(scheduler)
    io.inbox.append(run_to_max("all", PROMPT, logprob=LogprobParams(logprob_start_len=0)))
    run_until_idle(scheduler)
    io.inbox.append(run_to_max("tail", PROMPT, logprob=LogprobParams(logprob_start_len=6)))
    run_until_idle(scheduler)
    io.inbox.append(run_to_max("plain", PROMPT, logprob=LogprobParams()))
    run_until_idle(scheduler)
    first = {o.rid: o for o in io.outputs if o.prompt_logprobs is not None or o.rid == "plain"}
    assert first["all"].cached_tokens == 0
    assert len(first["all"].prompt_logprobs.logprobs) == len(PROMPT) - 1
    assert first["tail"].cached_tokens == 6
    assert first["tail"].prompt_logprobs.logprobs == [
        pytest_approx(model.logprob(PROMPT[i], PROMPT[i + 1])) for i in range(6, len(PROMPT) - 1)]
    assert first["plain"].cached_tokens == len(PROMPT) - 1
    assert first["plain"].prompt_logprobs is None and first["plain"].logprobs is not None


def test_penalties_and_bias_through_the_scheduler():
    scheduler, io, _ = scheduler_with_table()
    io.inbox.append(run_to_max("free", [4], max_new=12))
    io.inbox.append(run_to_max("penalized", [4], max_new=12, frequency_penalty=2.0,
                        presence_penalty=2.0, repetition_penalty=2.0))
    io.inbox.append(run_to_max("biased", [4], max_new=3, logit_bias={21: 100.0}))
    run_until_idle(scheduler)
    free, penalized = io.tokens("free"), io.tokens("penalized")
    assert len(set(free)) < len(free)  # the greedy walk through the table cycles
    assert len(set(penalized)) > len(set(free))
    assert io.tokens("biased") == [21, 21, 21]


def test_min_new_tokens_holds_eos_back():
    scheduler, io, _ = scheduler_with_table()
    message = request("a", [4], max_new=10, min_new_tokens=3, logit_bias={EOS: 100.0})
    io.inbox.append(message)
    run_until_idle(scheduler)
    tokens = io.tokens("a")
    assert len(tokens) == 4 and EOS not in tokens[:3] and tokens[3] == EOS
    assert io.finish("a").kind == "stop" and io.finish("a").matched_token == EOS


def letters_req(output: list[int], min_new: int, stop: list[str]) -> Req:
    return Req(rid="r", input_ids=[0], stream=False, output_ids=output,
               sampling=SamplingParams(min_new_tokens=min_new, stop=stop, max_new_tokens=100))


def test_stop_strings_wait_for_min_new_tokens():
    checker = StopChecker(LetterTokenizer(), {EOS}, 1000)  # type: ignore[arg-type]
    c, d, e = 2, 3, 4  # letters
    # "cd" appears at tokens 1-2, before min_new_tokens = 4: not a stop
    assert checker.check(letters_req([c, d], 4, ["cd"])) is None
    assert checker.check(letters_req([c, d, e, c], 4, ["cd"])) is None
    finish = checker.check(letters_req([c, d, e, c, d], 4, ["cd"]))
    assert finish is not None and finish.matched_str == "cd" and finish.num_earlier_matches == 1
    assert cut_at_stop("cdecd", "cd", finish.num_earlier_matches) == "cde"
    # without min_new_tokens the first occurrence stops, as before
    finish = checker.check(letters_req([c, d], 0, ["cd"]))
    assert finish is not None and finish.num_earlier_matches == 0
    assert cut_at_stop("xcdcd", "cd") == "x"


def pytest_approx(value: float) -> object:
    return pytest.approx(value, abs=1e-5)
