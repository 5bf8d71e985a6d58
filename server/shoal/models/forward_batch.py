"""What one forward pass computes, as tensors the model and attention backend read.

Every batch is an *extend*: each request appends `extend_len` new tokens to `prefix_len` tokens
whose K/V already sit in the pool. A decode row is simply `extend_len == 1`, so a batch may mix
prefill chunks and decode steps.

    request r:  [0 ............ prefix_len) [prefix_len ...... seq_len)
                  K/V already in the pool     new tokens, K/V written by this forward
                                              to out_cache_loc[token_offset[r] : +extend_len]

Contract: before the forward, `req_to_token[req_pool_indices[r], prefix_len:seq_len]` already
holds the new tokens' slots (the same values as the matching `out_cache_loc` range).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # [num_tokens] int64
    positions: torch.Tensor        # [num_tokens] int64
    out_cache_loc: torch.Tensor    # [num_tokens] int64: KV slot of each new token
    req_pool_indices: torch.Tensor  # [batch] int64: each request's row of req_to_token
    seq_lens: torch.Tensor         # [batch] int64: prefix_len + extend_len
    extend_lens: list[int]         # [batch] new tokens per request
    # token indices whose logits the model returns, in order; None: each request's last new
    # token (the normal case; prompt logprobs ask for more positions)
    logit_indices: torch.Tensor | None = None
    # only each logits row's argmax is read (greedy requests that ask for nothing else): the LM
    # head may leave every logit that cannot be the largest at -inf
    argmax_only: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @cached_property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens)

    @cached_property
    def seq_lens_list(self) -> list[int]:
        return self.seq_lens.tolist()

    @cached_property
    def last_token_indices(self) -> torch.Tensor:
        """Index into the token dimension of each request's last new token."""
        ends = torch.tensor(self.extend_lens, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.input_ids.device)

    @property
    def logits_at(self) -> torch.Tensor:
        """Token indices whose logits the last stage computes."""
        return self.last_token_indices if self.logit_indices is None else self.logit_indices
