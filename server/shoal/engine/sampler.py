"""Next-token sampling: penalties and logit_bias, grammar token masks (structured outputs),
greedy, temperature, top-k, top-p, min-p, per-request seeded generators; and the
log-probabilities a step's requests asked for (of the raw logits: masks do not change them).

A batch where no request processes its logits or wants logprobs costs one argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import xgrammar as xgr

from shoal.engine import penalties
from shoal.engine.logprobs import batch_logprobs, token_logprobs
from shoal.engine.penalties import PenaltyState
from shoal.ipc.messages import LogprobParams, SamplingParams, SamplingResult, TokenLogprobs


class SamplingRow(Protocol):
    """What sampling reads of a request (the scheduler's `Req`)."""

    sampling: SamplingParams
    generator: torch.Generator | None
    output_ids: list[int]
    penalties: PenaltyState | None
    logprob: LogprobParams | None
    grammar: xgr.GrammarMatcher | None  # None: every token is allowed


@dataclass
class PromptSlice:
    """Consecutive logits rows [row, row + len(target_ids)) that score prompt tokens."""

    row: int
    target_ids: list[int]
    top_n: int


@dataclass
class SamplingWork:
    """One step's sampling: a token for each of `reqs` from logits row `rows[i]`, plus the
    log-probabilities of the `prompt` slices."""

    reqs: list[SamplingRow]
    rows: list[int]
    prompt: list[PromptSlice] = field(default_factory=list)

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.prompt) or any(r.logprob is not None for r in self.reqs)


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A per-request generator, so a seeded request samples the same way in any batch."""
    if params.is_greedy:
        return None
    generator = torch.Generator()
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def run(logits: torch.Tensor, work: SamplingWork) -> SamplingResult:
    """Sample `work` from `logits` [rows, vocab] (float32)."""
    every_row = work.rows == list(range(logits.shape[0]))  # a decode batch: no copy to pick
    picked = logits if every_row else logits[work.rows]
    result = SamplingResult(tokens=sample(picked, work.reqs))
    if work.wants_logprobs:
        result.logprobs = output_logprobs(picked, result.tokens, work.reqs)
        result.prompt_logprobs = [
            token_logprobs(logits[s.row:s.row + len(s.target_ids)], s.target_ids, s.top_n)
            for s in work.prompt]
    return result


def sample(logits: torch.Tensor, reqs: list[SamplingRow]) -> list[int]:
    """One token id per row of `logits` [batch, vocab] (float32); `logits` is not modified."""
    logits = apply_grammar_masks(penalties.apply(logits, reqs), reqs)
    tokens = logits.argmax(dim=-1).tolist()
    for i, req in enumerate(reqs):
        if not req.sampling.is_greedy:
            tokens[i] = _sample_row(logits[i], req.sampling, req.generator)
    return tokens


def apply_grammar_masks(logits: torch.Tensor, reqs: list[SamplingRow]) -> torch.Tensor:
    """`logits` with the tokens each request's grammar forbids at -inf (a copy); the same
    tensor when no request has a grammar."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return logits
    bitmask = xgr.allocate_token_bitmask(len(reqs), logits.shape[-1])
    for i in rows:
        grammar = reqs[i].grammar
        assert grammar is not None
        grammar.fill_next_token_bitmask(bitmask, i)
    masked = logits.clone()
    xgr.apply_token_bitmask_inplace(masked, bitmask.to(masked.device), indices=rows)
    return masked


def output_logprobs(logits: torch.Tensor, tokens: list[int],
                    reqs: list[SamplingRow]) -> list[TokenLogprobs | None]:
    """Each sampled token's log-probability (and top alternatives), for the requests that ask."""
    wanted = [i for i, r in enumerate(reqs) if r.logprob is not None]
    out: list[TokenLogprobs | None] = [None] * len(reqs)
    if not wanted:
        return out
    top_ns = [_top_n(reqs[i].logprob) for i in wanted]
    batch = batch_logprobs(logits[wanted], [tokens[i] for i in wanted], top_ns)
    for j, (i, n) in enumerate(zip(wanted, top_ns)):
        out[i] = batch.slice(j, j + 1) if n else TokenLogprobs(logprobs=[batch.logprobs[j]])
    return out


def _top_n(logprob: LogprobParams | None) -> int:
    return logprob.top_logprobs_num if logprob is not None else 0


def token_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The normalized distribution [vocab] that a non-greedy row samples from."""
    sorted_probs, sorted_ids = _filtered_sorted(logits, params)
    probs = torch.zeros_like(sorted_probs).scatter_(0, sorted_ids, sorted_probs)
    return probs / probs.sum()


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    sorted_probs, sorted_ids = _filtered_sorted(logits, p)
    choice = torch.multinomial(sorted_probs.cpu(), 1, generator=generator)
    return int(sorted_ids[choice.to(sorted_ids.device)].item())


def _filtered_sorted(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities at temperature `p.temperature`, sorted descending, with the tokens that
    top-k, top-p and min-p exclude set to 0 (not renormalized); and their token ids."""
    probs = torch.softmax(logits.float() / p.temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        # NOTE: a temperature so small (1e-320), or a penalized logit so large, that the scaled
        # logits overflow: the distribution's limit puts all its mass on the argmax
        probs = torch.zeros_like(probs).index_fill_(0, logits.argmax().view(1), 1.0)
    sorted_probs, sorted_ids = probs.sort(descending=True)
    if p.top_k > 0:
        sorted_probs[p.top_k:] = 0.0
    if p.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        drop[0] = False  # even when top_p is 0 in float32 (5e-324)
        sorted_probs[drop] = 0.0
    if p.min_p > 0.0:
        sorted_probs[sorted_probs < p.min_p * sorted_probs[0]] = 0.0
    return sorted_probs, sorted_ids
