"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeded generators."""

from __future__ import annotations

import torch

from shoal.ipc.messages import SamplingParams


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


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token id per row of `logits` [batch, vocab] (float32)."""
    greedy = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.is_greedy:
            greedy[i] = _sample_row(logits[i], p, generators[i])
    return greedy


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    probs = torch.softmax(logits.float() / p.temperature, dim=-1)
    sorted_probs, sorted_ids = probs.sort(descending=True)
    if p.top_k > 0:
        sorted_probs[p.top_k:] = 0.0
    if p.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        sorted_probs[mass_before >= p.top_p] = 0.0
    if p.min_p > 0.0:
        sorted_probs[sorted_probs < p.min_p * sorted_probs[0]] = 0.0
    choice = torch.multinomial(sorted_probs.cpu(), 1, generator=generator)
    return int(sorted_ids[choice.to(sorted_ids.device)].item())
