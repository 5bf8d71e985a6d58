"""What a model's attention layers call: the seam between the model and the KV memory.

The model calls `prepare(batch)` once per forward, then `forward(layer, q, k, v, how)` in every
layer. A backend writes the new tokens' K/V to the pool and attends each new token to its
request's tokens `req_to_token[req_pool_idx, :seq_len]`, causally: new token i of a request
(position `prefix_len + i`) sees the positions `0 .. prefix_len + i`, and in a sliding-window
layer only the last `how.sliding_window` of them. The pool keeps every layer's K/V for every
position, so a cached prefix serves window and full layers alike. The engine provides the
backends (`shoal.engine.attention`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from shoal.kernels.interface import PagedDecode
from shoal.models.forward_batch import ForwardBatch


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends. `scale`: the factor of q.k (None: head_dim ** -0.5);
    `sliding_window`: a query at position i sees the keys at i - window < j <= i (None: all
    before it); `softcap`: scores become softcap * tanh(scores / softcap) before the mask and
    softmax (Gemma 2)."""

    scale: float | None = None
    sliding_window: int | None = None
    softcap: float | None = None

    @property
    def masks_beyond_causal(self) -> bool:
        return self.sliding_window is not None or self.softcap is not None


FULL_ATTENTION = LayerAttention()


class AttentionBackend(ABC):
    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Precompute whatever every layer of this forward shares (indices, masks)."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                how: LayerAttention = FULL_ATTENTION) -> torch.Tensor:
        """Store k/v [num_tokens, num_kv_heads, head_dim] at `batch.out_cache_loc` in `layer`'s
        buffers and return the attention output for q [num_tokens, num_heads, head_dim], of the
        same shape as q, attending as `how` says. Only valid after `prepare` of the batch these
        tokens belong to."""

    def paged_decode(self) -> PagedDecode | None:
        """The prepared batch's K/V in place, when every row is a decode row and the pools are
        CPU float32 buffers a kernel may write; else None (the default)."""
        return None
