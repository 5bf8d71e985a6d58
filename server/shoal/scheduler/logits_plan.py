"""Which positions of a batch the model returns logits for.

Normally only each request's last new token (the one that may be sampled). A request that wants
prompt logprobs also needs the logits of every prompt position it computes this step in
[next_prompt_logprob_pos, len(input_ids) - 1): the logits at position p score prompt token p + 1.
Each such position becomes one row of the logits the forward returns.

    request r, computing positions [c, c + n) this step (token offset o in the batch):
      prompt rows:  o + (lo - c) ... o + (hi - c) - 1   lo = max(c, next), hi = min(c + n, L - 1)
      last row:     o + n - 1   (already among the prompt rows when hi == c + n)

An entry that verifies k proposed tokens (speculative decoding) needs the logits of all its
n = 1 + k positions, one row each (`plan_verification`); a batch has one plan or the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.engine.sampler import PromptSlice
from shoal.ipc.messages import TokenLogprobs
from shoal.scheduler.request import Req


@dataclass
class LogitsPlan:
    indices: list[int]         # token indices whose logits the forward returns, ascending
    last_rows: list[int]       # per batch entry: the logits row of its request's last new token
    slices: list[PromptSlice]  # prompt positions scored this step
    owners: list[Req]          # the request of each slice

    def record(self, prompt_logprobs: list[TokenLogprobs]) -> None:
        for req, logprobs in zip(self.owners, prompt_logprobs):
            assert req.prompt_logprobs is not None
            req.prompt_logprobs.extend(logprobs)


@dataclass
class Verification:
    """The logits rows of a batch with entries that verify proposed tokens: `indices` (token
    indices the forward returns), each entry's last row, and for each verifying entry its index
    in the batch, its proposal and the rows of its 1 + len(proposal) positions."""

    indices: list[int] = field(default_factory=list)
    last_rows: list[int] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)
    proposals: list[list[int]] = field(default_factory=list)
    rows: list[list[int]] = field(default_factory=list)


def plan_verification(entries: list[tuple[Req, int]],
                      proposals: list[list[int]]) -> Verification:
    """The rows of a batch whose entries with a proposal verify it (every position's logits);
    the others need their last token's only."""
    plan = Verification()
    offset = 0
    for i, ((_, n), proposal) in enumerate(zip(entries, proposals)):
        if proposal:
            plan.entries.append(i)
            plan.proposals.append(proposal)
            plan.rows.append(list(range(len(plan.indices), len(plan.indices) + n)))
            plan.indices += range(offset, offset + n)
        else:
            plan.indices.append(offset + n - 1)
        plan.last_rows.append(len(plan.indices) - 1)
        offset += n
    return plan


def plan_logits(entries: list[tuple[Req, int]]) -> LogitsPlan | None:
    """The plan for a batch of entries (request, tokens computed); None when every request needs
    only its last token's logits (the model's default)."""
    if not any(req.needs_prompt_logprobs for req, _ in entries):
        return None
    plan = LogitsPlan(indices=[], last_rows=[], slices=[], owners=[])
    offset = 0
    for req, n in entries:
        start, end = req.computed_len, req.computed_len + n
        if req.needs_prompt_logprobs:
            assert req.logprob is not None
            lo, hi = max(start, req.next_prompt_logprob_pos), min(end, len(req.input_ids) - 1)
            if lo < hi:
                plan.slices.append(PromptSlice(row=len(plan.indices),
                                               target_ids=req.input_ids[lo + 1:hi + 1],
                                               top_n=req.logprob.top_logprobs_num))
                plan.owners.append(req)
                plan.indices += range(offset + lo - start, offset + hi - start)
        if not plan.indices or plan.indices[-1] != offset + n - 1:
            plan.indices.append(offset + n - 1)
        plan.last_rows.append(len(plan.indices) - 1)
        offset += n
    return plan
