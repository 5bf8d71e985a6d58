"""Logit processing before sampling: penalties, the min-tokens mask and logit_bias.

Applied to a copy of the raw logits, per request, in this order:

1. repetition_penalty r over every token in the prompt or the output (transformers / SGLang):
   a positive logit is divided by r, a negative one multiplied by r;
2. frequency_penalty f and presence_penalty p over the output only (OpenAI):
   logit -= f * count(token) + p * (count(token) > 0);
3. while fewer than min_new_tokens tokens were generated, the stop tokens (stop_token_ids, and
   EOS unless ignore_eos) are masked to -inf;
4. logit_bias: logit += bias[token].

A request without any of these has no `PenaltyState`, and a batch without one costs nothing.
Each state keeps a [vocab] count tensor that catches up with the request's output ids when the
batch is sampled, so only the rank that samples ever builds it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from shoal.ipc.messages import SamplingParams


class PenaltyState:
    def __init__(self, params: SamplingParams, prompt_ids: list[int],
                 stop_ids: list[int]) -> None:
        self.params = params
        self.prompt_ids = prompt_ids
        self.stop_ids = stop_ids        # masked while the output is shorter than min_new_tokens
        self.counts: torch.Tensor | None = None  # [vocab] float32: occurrences in the output
        self.seen: torch.Tensor | None = None    # [vocab] bool: in the prompt or the output
        self.num_counted = 0                     # output ids already in `counts` / `seen`

    @property
    def uses_counts(self) -> bool:
        p = self.params
        return bool(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0)

    def catch_up(self, output_ids: list[int], vocab: int, device: torch.device) -> None:
        if not self.uses_counts:
            return
        if self.counts is None or self.seen is None:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.seen[_ids(self.prompt_ids, vocab, device)] = True
            self.num_counted = 0
        new = output_ids[self.num_counted:]
        if new:
            ids = _ids(new, vocab, device)
            self.counts.index_put_((ids,), torch.ones(len(ids), device=device), accumulate=True)
            self.seen[ids] = True
            self.num_counted = len(output_ids)


def make_state(params: SamplingParams, prompt_ids: list[int],
               eos_token_ids: set[int]) -> PenaltyState | None:
    """The state of a request whose logits need processing; None for the plain ones."""
    if not params.processes_logits:
        return None
    stop_ids = list(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids += sorted(eos_token_ids - set(stop_ids))
    return PenaltyState(params, prompt_ids, stop_ids)


class PenalizedRow(Protocol):
    output_ids: list[int]
    penalties: PenaltyState | None


def apply(logits: torch.Tensor, reqs: list[PenalizedRow]) -> torch.Tensor:
    """`logits` [batch, vocab] (row i for reqs[i]) after each request's processing; the same
    tensor, untouched, when no request has any."""
    indices = [i for i, r in enumerate(reqs) if r.penalties is not None]
    if not indices:
        return logits
    logits = logits.clone()
    vocab, device = logits.shape[-1], logits.device
    states: list[tuple[int, PenaltyState, list[int]]] = []
    for i in indices:
        state = reqs[i].penalties
        assert state is not None
        state.catch_up(reqs[i].output_ids, vocab, device)
        states.append((i, state, reqs[i].output_ids))
    _repetition(logits, [(i, s) for i, s, _ in states if s.params.repetition_penalty != 1.0])
    _frequency_presence(logits, [(i, s) for i, s, _ in states
                                 if s.params.frequency_penalty or s.params.presence_penalty])
    for i, state, output_ids in states:
        if len(output_ids) < state.params.min_new_tokens and state.stop_ids:
            logits[i, _ids(state.stop_ids, vocab, device)] = float("-inf")
        if state.params.logit_bias:
            bias = state.params.logit_bias
            keep = [t for t in bias if 0 <= t < vocab]
            logits[i, torch.tensor(keep, dtype=torch.int64, device=device)] += torch.tensor(
                [bias[t] for t in keep], dtype=logits.dtype, device=device)
    return logits


def _repetition(logits: torch.Tensor, rows: list[tuple[int, PenaltyState]]) -> None:
    if not rows:
        return
    index = torch.tensor([i for i, _ in rows], dtype=torch.int64, device=logits.device)
    seen = torch.stack([s.seen for _, s in rows if s.seen is not None])
    penalty = _param_column(rows, "repetition_penalty", logits)
    sub = logits[index]
    penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits[index] = torch.where(seen, penalized, sub)


def _frequency_presence(logits: torch.Tensor, rows: list[tuple[int, PenaltyState]]) -> None:
    if not rows:
        return
    index = torch.tensor([i for i, _ in rows], dtype=torch.int64, device=logits.device)
    counts = torch.stack([s.counts for _, s in rows if s.counts is not None])
    frequency = _param_column(rows, "frequency_penalty", logits)
    presence = _param_column(rows, "presence_penalty", logits)
    logits[index] -= frequency * counts + presence * (counts > 0).to(logits.dtype)


def _param_column(rows: list[tuple[int, PenaltyState]], name: str, logits: torch.Tensor
                  ) -> torch.Tensor:
    """Sampling parameter `name` of each row as a [rows, 1] column broadcasting over the vocab."""
    return torch.tensor([getattr(s.params, name) for _, s in rows], dtype=logits.dtype,
                        device=logits.device).unsqueeze(1)


def _ids(ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([t for t in ids if 0 <= t < vocab], dtype=torch.int64, device=device)
