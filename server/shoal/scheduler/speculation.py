"""Speculative decoding by prompt lookup (n-gram speculation, `--speculative-algorithm ngram`).

A decode step of a request that speculates computes its last token plus up to N proposed tokens
in one forward, as a short extend, and reads the logits of every one of those positions:

    positions  c      c+1   ...  c+k        (c = computed_len, k proposed tokens d1..dk)
    inputs     last   d1    ...  dk
    logits     -> t1  -> t2 ...  -> t(k+1)  the target's choice after each prefix

Proposal (`NgramProposer.propose`) is a pure function of the token ids: the continuation of the
latest earlier occurrence of their last n-gram. Acceptance (`accept_greedy`, `accept_sampled`)
is a pure function of the proposal and the target's logits: every step yields the accepted
proposals plus one token of the target's own, so greedy output is the same token for token as
without speculation, and sampled output has the same distribution (the proposal is a point
mass, so a proposed token t is kept with probability p(t), and on rejection the token comes from
p with t removed, renormalized). With a grammar (structured outputs), the proposal is cut to
what the grammar accepts (`grammar_prefix`) and each position's logits are masked by the
grammar's state after the proposals before it (`grammar_masked`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr

from shoal.engine import sampler
from shoal.ipc.messages import SamplingParams

ALGORITHMS = ("ngram",)  # --speculative-algorithm values (case-insensitive)
MAX_NGRAM = 4  # the longest suffix looked up; shorter ones are tried when it has no match
MIN_NGRAM = 1


@dataclass(frozen=True)
class NgramProposer:
    """Proposes up to `num_draft_tokens` tokens by prompt lookup."""

    num_draft_tokens: int

    def propose(self, token_ids: Sequence[int], limit: int) -> list[int]:
        """At most min(limit, num_draft_tokens) tokens that followed the latest earlier
        occurrence of the longest suffix of `token_ids` (MAX_NGRAM down to MIN_NGRAM tokens)
        that occurred before; [] when none did."""
        limit = min(limit, self.num_draft_tokens)
        if limit <= 0 or len(token_ids) < 2:
            return []
        ids = np.asarray(token_ids)
        best_len, best_end = 0, 0
        # every earlier position holding the last token ends a match; latest first
        for end in np.flatnonzero(ids[:-1] == ids[-1])[::-1].tolist():
            n = 1
            while n < MAX_NGRAM and end - n >= 0 and ids[end - n] == ids[-1 - n]:
                n += 1
            if n > best_len:
                best_len, best_end = n, end
                if n == MAX_NGRAM:
                    break
        if best_len < MIN_NGRAM:
            return []
        return ids[best_end + 1:best_end + 1 + limit].tolist()


def accept_greedy(proposal: Sequence[int], target: Sequence[int]) -> list[int]:
    """The tokens a greedy verify step yields: the longest prefix of `proposal` that equals the
    target's argmax `target` at each position (len(proposal) + 1 of them), then the target's
    token at the first difference (or after the last proposal)."""
    assert len(target) == len(proposal) + 1
    out: list[int] = []
    for proposed, chosen in zip(proposal, target):
        out.append(chosen)
        if proposed != chosen:
            return out
    out.append(target[-1])
    return out


def accept_sampled(proposal: Sequence[int], probs: torch.Tensor,
                   generator: torch.Generator | None) -> list[int]:
    """The tokens a sampled verify step yields, from the target's distributions `probs`
    [len(proposal) + 1, vocab] (each row normalized): proposed token t at row i is kept with
    probability probs[i, t]; the first one rejected is replaced by a draw from probs[i] with t
    removed and renormalized, and the step ends; when all are kept, a draw from the last row
    follows. The result is distributed as sampling each token from the target directly."""
    assert probs.shape[0] == len(proposal) + 1
    probs = probs.cpu()
    out: list[int] = []
    for i, proposed in enumerate(proposal):
        if float(torch.rand(1, generator=generator)) < float(probs[i, proposed]):
            out.append(proposed)
            continue
        residual = probs[i].clone()
        residual[proposed] = 0.0
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[-1], 1, generator=generator)))
    return out


def grammar_prefix(matcher: xgr.GrammarMatcher, proposal: Sequence[int]) -> list[int]:
    """The longest prefix of `proposal` that the grammar accepts from its state without
    ending (the target's own token ends it); the matcher is left as it was."""
    accepted = 0
    while accepted < len(proposal) and not matcher.is_terminated() \
            and matcher.accept_token(proposal[accepted]):
        accepted += 1
    kept = accepted - 1 if matcher.is_terminated() else accepted  # the ending token: the target's
    if accepted:
        matcher.rollback(accepted)
    return list(proposal[:kept])


def grammar_masked(logits: torch.Tensor, matcher: xgr.GrammarMatcher,
                   proposal: Sequence[int]) -> torch.Tensor:
    """A verify step's logits [len(proposal) + 1, vocab] with row i masked by the grammar's
    state after proposal[:i] (a copy; the matcher is left as it was). The proposal is one
    `grammar_prefix` kept, so the grammar accepts every token of it."""
    bitmask = xgr.allocate_token_bitmask(len(proposal) + 1, logits.shape[-1])
    for i, token in enumerate([*proposal, None]):
        matcher.fill_next_token_bitmask(bitmask, i)
        if token is not None and not matcher.accept_token(token):
            raise AssertionError(f"the grammar refused proposed token {token}")
    if proposal:
        matcher.rollback(len(proposal))
    masked = logits.clone()
    xgr.apply_token_bitmask_inplace(masked, bitmask.to(masked.device))
    return masked


def verify(logits: torch.Tensor, proposal: Sequence[int], params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """The tokens a verify step yields from the target's float32 logits [len(proposal) + 1,
    vocab] at the step's positions (a grammar's masks applied: `grammar_masked`), for a request
    sampled with `params` (no other logit processing: requests with penalties or logprobs do
    not speculate)."""
    if params.is_greedy:
        return accept_greedy(proposal, logits.argmax(dim=-1).tolist())
    probs = torch.stack([sampler.token_distribution(row, params) for row in logits])
    return accept_sampled(proposal, probs, generator)
