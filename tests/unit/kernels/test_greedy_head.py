"""The screened LM head of greedy steps: the argmax of the full float32 head, always; and the
scheduler asks for it only when every request of a step reads nothing but its argmax."""

from __future__ import annotations

import msgspec
import pytest
import torch
import torch.nn.functional as F

from shoal.ipc.messages import LogprobParams
from shoal.kernels.greedy_head import GreedyHead
from tests.support.scheduler import make_scheduler, request, run_until_idle


def _check(head: GreedyHead, weight: torch.Tensor, hidden: torch.Tensor) -> None:
    got = head.logits(hidden)
    exact = F.linear(hidden, weight)
    assert torch.equal(got.argmax(dim=-1), exact.argmax(dim=-1))
    kept = torch.isfinite(got)
    assert kept.any(dim=1).all()
    torch.testing.assert_close(got[kept], exact[kept], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_the_screened_head_gives_the_full_heads_argmax(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(5000, 64, generator=gen) * 0.05  # the bound taken in two slices
    head = GreedyHead.of(weight)
    for _ in range(20):
        _check(head, weight, torch.randn(rows, 64, generator=gen) * 3)


def test_a_row_the_int8_copy_ranks_lower_is_still_the_one_picked() -> None:
    """Row 3's int8 copy rounds its logit up to 1/127, row 7's (a finer scale) down: the copy
    ranks 3 first, the float32 weights 7, and the bound keeps 7 among the candidates."""
    weight = torch.zeros(50, 8)
    weight[3, 1], weight[3, 2] = 0.51 / 127, 1.0
    weight[7, 1], weight[7, 2] = 0.0045, 0.5
    hidden = torch.zeros(1, 8)
    hidden[0, 1] = 1.0
    head = GreedyHead.of(weight)
    approx = weight.clone()
    for row in (3, 7):
        scale = weight[row].abs().max() / 127
        approx[row] = torch.round(weight[row] / scale) * scale
    assert int(F.linear(hidden, approx).argmax()) == 3
    assert int(head.logits(hidden).argmax()) == 7 == int(F.linear(hidden, weight).argmax())


def test_a_zero_hidden_state_ties_every_logit_and_picks_the_first() -> None:
    weight = torch.randn(200, 16)
    got = GreedyHead.of(weight).logits(torch.zeros(2, 16))
    assert torch.isfinite(got).all() and got.argmax(dim=-1).tolist() == [0, 0]


@pytest.mark.parametrize(("params", "sampled", "argmax_only"), [
    ({}, False, True),
    ({}, True, False),
    ({"logprob": LogprobParams(top_logprobs_num=2)}, False, False),
    ({"repetition_penalty": 1.3}, False, False),
])
def test_the_scheduler_asks_for_argmaxes_only_when_no_request_reads_more(
        params: dict[str, object], sampled: bool, argmax_only: bool) -> None:
    scheduler, io, model = make_scheduler()
    other = request("other", [4, 5, 6], max_new=3, ignore_eos=True, **params)
    if sampled:
        other.sampling = msgspec.structs.replace(other.sampling, temperature=0.7)
    io.inbox += [request("greedy", [1, 2, 3], max_new=3, ignore_eos=True), other]
    run_until_idle(scheduler)
    assert len(model.batches) == 3 and all(len(b.extend_lens) == 2 for b in model.batches)
    assert all(b.argmax_only is argmax_only for b in model.batches)
