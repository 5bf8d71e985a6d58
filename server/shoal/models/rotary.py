"""Rotary position embeddings of every rope type `RopeConfig` describes: default, llama3,
linear and longrope (Phi-3), over all of each head's dims or its leading
`partial_rotary_factor` share.

Neox style (rotate-half), as transformers computes them: `Rotary.rotate(x, cos, sin)`
with cos / sin from `cos_sin(positions)`.
"""

from __future__ import annotations

import math

import torch

from shoal.model_config import RopeConfig


class Rotary:
    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        self.rope = rope
        self.dim = int(head_dim * rope.partial_rotary_factor)
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim
        base = rope.theta ** exponents
        self.inv_freq = 1.0 / base
        self.long_inv_freq: torch.Tensor | None = None
        if rope.rope_type == "llama3":
            self.inv_freq = _llama3_inv_freq(self.inv_freq, rope)
        elif rope.rope_type == "linear":
            self.inv_freq = self.inv_freq / rope.factor
        elif rope.rope_type == "longrope":
            self.inv_freq = 1.0 / (torch.tensor(rope.short_factor) * base)
            self.long_inv_freq = 1.0 / (torch.tensor(rope.long_factor) * base)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the half-negated sin [num_tokens, 1, rotary dims], broadcasting over heads.
        longrope: a position from `original_max_position_embeddings` on turns by the long
        factors, one before it by the short ones (transformers picks one set per sequence, by
        its length: the same for every sequence that stays below the original length)."""
        freqs = positions[:, None].float() * self.inv_freq
        if self.long_inv_freq is not None:
            assert self.rope.original_max_position_embeddings is not None
            long = positions[:, None] >= self.rope.original_max_position_embeddings
            freqs = torch.where(long, positions[:, None].float() * self.long_inv_freq, freqs)
        cos = torch.cat((freqs, freqs), dim=-1)[:, None, :].cos()
        sin = torch.cat((-freqs, freqs), dim=-1)[:, None, :].sin()
        if self.rope.attention_factor != 1.0:
            cos, sin = cos * self.rope.attention_factor, sin * self.rope.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] with its leading rotary dims turned."""
        if self.dim == x.shape[-1]:
            return _rotate_half(x, cos, sin)
        turned = _rotate_half(x[..., :self.dim], cos, sin)
        return torch.cat((turned, x[..., self.dim:]), dim=-1)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, the sign of rotate_half folded into `sin`."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: low frequencies divided by `factor`, a smooth ramp in between."""
    assert rope.original_max_position_embeddings is not None
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
