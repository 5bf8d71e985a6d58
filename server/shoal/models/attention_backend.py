"""What a model's attention layers call: the seam between the model and the KV memory.

The model calls `prepare(batch)` once per forward, then `forward(layer, q, k, v)` in every layer.
A backend writes the new tokens' K/V to the pool and attends each new token to its request's
tokens `req_to_token[req_pool_idx, :seq_len]`, causally: new token i of a request (position
`prefix_len + i`) sees the positions `0 .. prefix_len + i`. The engine provides the backends
(`shoal.engine.attention`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from shoal.kernels.interface import PagedDecode
from shoal.models.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Precompute whatever every layer of this forward shares (indices, masks)."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> torch.Tensor:
        """Store k/v [num_tokens, num_kv_heads, head_dim] at `batch.out_cache_loc` in `layer`'s
        buffers and return the attention output for q [num_tokens, num_heads, head_dim], of the
        same shape as q. Only valid after `prepare` of the batch these tokens belong to."""

    def paged_decode(self) -> PagedDecode | None:
        """The prepared batch's K/V in place, when every row is a decode row and the pools are
        CPU float32 buffers a kernel may write; else None (the default)."""
        return None
