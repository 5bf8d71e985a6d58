"""Weight-only int8 (`--quantization w8a16`): each weight row (output channel) becomes int8 with
one float32 scale, symmetric around zero: w ~ q * scale, scale = max|row| / 127.

Only the linear weights (and the embedding, which shares the LM head's weight when tied) are
quantized; norms, the residual stream, attention and the KV cache stay in the model's dtype. How
the int8 products run is `shoal.kernels.linear_kernels`' business.
"""

from __future__ import annotations

import torch

QUANTIZATIONS = ("none", "w8a16")
_INT8_MAX = 127


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] float -> (int8 [out, in] contiguous, float32 scale [out])."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / _INT8_MAX
    q = torch.round(weight / scale[:, None]).clamp_(-_INT8_MAX, _INT8_MAX)
    return q.to(torch.int8).contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]
