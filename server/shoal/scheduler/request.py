"""A request as the scheduler tracks it: progress is lengths, not phases.

    fill_ids = input_ids + output_ids
    [0 ............ cached_len) [cached_len ........ len(fill_ids))
      K/V in the pool             still to compute (a prefill chunk, or the last sampled token)

A request is in prefill while `cached_len < len(input_ids)`; afterwards every step extends it by
exactly the one token sampled last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from shoal.ipc.messages import FinishReason, SamplingParams
from shoal.scheduler.prefix_cache import TreeNode


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None                 # row in req_to_token while it holds KV
    cached_len: int = 0                    # tokens whose K/V are in the pool
    cache_owned_len: int = 0               # leading tokens whose K/V the prefix cache owns
    prefix_node: TreeNode | None = None    # the locked prefix-cache node ending that prefix
    cached_tokens: int = 0                 # prompt tokens served from the prefix cache
    was_admitted: bool = False             # a retracted request keeps its first cached_tokens
    finish: FinishReason | None = None
    generator: torch.Generator | None = None
    num_sent_ids: int = 0                  # output ids already sent to the detokenizer
    created_at: float = field(default_factory=time.monotonic)

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def fill_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def extend_len(self) -> int:
        return self.fill_len - self.cached_len

    @property
    def is_prefilling(self) -> bool:
        return self.cached_len < len(self.input_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.sampling.max_new_tokens - len(self.output_ids), 0)
