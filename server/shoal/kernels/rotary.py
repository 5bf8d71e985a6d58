"""The rotary embedding's convention, which the models' cos / sin follow and the kernels compute.

Rotate-half (Neox) RoPE: x * cos + rotate_half(x) * sin, where cos and sin [tokens, 1, dim] hold
each position's angles twice over the head dimension, sin's first half negated (sin(-a) =
-sin(a) exactly), so rotate_half is a swap of the halves.
"""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [tokens, heads, dim], with the sign of rotate_half folded into
    `sin` to save a negation per call."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin
