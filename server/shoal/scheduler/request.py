"""A request as the scheduler tracks it: progress is lengths, not phases.

    token_ids = input_ids + output_ids: one list, appended in place (`append_token`)
    [0 ............ computed_len) [computed_len ............ total_len)
      K/V computed, in the pool     still to compute: a prefill chunk, or the last sampled token
    total_len = len(token_ids) + num_pending   (pending: sampled by a batch whose results are not
                                                processed yet, the overlap loop; id not known)

A request is in prefill while `computed_len < len(input_ids)`; afterwards every step extends it
by exactly the one token sampled last (`extend_len == 1`). "Cached" means the prefix cache only:
the first `cache_owned_len` tokens' K/V belong to the cache, and `prefix_hit_len` prompt tokens
were served from it when the request was first admitted (what usage reports as cached_tokens).

Prompt log-probabilities score prompt token i+1 with the logits at position i, for positions
[logprob_start_len, len(input_ids) - 1); they are collected chunk by chunk, so until they are
complete the prefix-cache match stops at the first position still to score.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from shoal.engine import penalties, sampler
from shoal.engine.penalties import PenaltyState
from shoal.ipc.messages import (
    FinishReason,
    GenerateReq,
    LogprobParams,
    SamplingParams,
    TokenLogprobs,
)
from shoal.scheduler.prefix_cache import TreeNode


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool
    output_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(init=False)  # input_ids + output_ids, appended in place
    req_pool_idx: int | None = None        # its row of the req_to_token table while it holds KV
    computed_len: int = 0                  # leading tokens whose K/V are in the pool
    cache_owned_len: int = 0               # leading tokens whose K/V the prefix cache owns
    prefix_node: TreeNode | None = None    # the locked prefix-cache node ending that prefix
    prefix_hit_len: int = 0                # prompt tokens served from the prefix cache
    was_admitted: bool = False             # a retracted request keeps its first prefix_hit_len
    finish: FinishReason | None = None
    generator: torch.Generator | None = None
    num_sent_ids: int = 0                  # output ids already sent to the detokenizer
    created_at: float = field(default_factory=time.monotonic)
    penalties: PenaltyState | None = None  # None: logits go to sampling unprocessed
    logprob: LogprobParams | None = None   # None: no log-probabilities asked
    output_logprobs: TokenLogprobs | None = None  # one per output id, when asked
    prompt_logprobs: TokenLogprobs | None = None  # from position logprob_start_len on, when asked
    num_pending: int = 0   # tokens sampled by batches not processed yet (the overlap loop)
    epoch: int = 0         # +1 whenever the request gives its KV back; older batch rows are stale
    grammar: xgr.GrammarMatcher | None = None  # structured outputs (grammar.py): masks sampling

    def __post_init__(self) -> None:
        self.token_ids = self.input_ids + self.output_ids

    @classmethod
    def from_message(cls, message: GenerateReq, eos_token_ids: set[int]) -> Req:
        input_ids = list(message.input_ids)
        logprob = message.logprob
        return cls(rid=message.rid, input_ids=input_ids, sampling=message.sampling,
                   stream=message.stream, generator=sampler.make_generator(message.sampling),
                   penalties=penalties.make_state(message.sampling, input_ids, eos_token_ids),
                   logprob=logprob,
                   output_logprobs=TokenLogprobs() if logprob is not None else None,
                   prompt_logprobs=(TokenLogprobs() if logprob is not None
                                    and logprob.logprob_start_len >= 0 else None))

    def append_token(self, token: int) -> None:
        """A sampled token whose id is now known (it was pending until its batch's results)."""
        self.output_ids.append(token)
        self.token_ids.append(token)

    @property
    def total_len(self) -> int:
        """Tokens so far, counting those sampled but not known yet (`num_pending`)."""
        return len(self.token_ids) + self.num_pending

    @property
    def extend_len(self) -> int:
        """Tokens to compute to catch up with `total_len`."""
        return self.total_len - self.computed_len

    @property
    def next_prompt_logprob_pos(self) -> int:
        """First position whose prompt logprob is still to collect."""
        assert self.logprob is not None and self.prompt_logprobs is not None
        start = min(self.logprob.logprob_start_len, len(self.input_ids) - 1)
        return start + len(self.prompt_logprobs.logprobs)

    @property
    def needs_prompt_logprobs(self) -> bool:
        return (self.prompt_logprobs is not None
                and self.next_prompt_logprob_pos < len(self.input_ids) - 1)

    @property
    def max_prefix_match_len(self) -> int:
        """How much of token_ids the prefix cache may serve: all but the last token (whose
        logits are needed), and no position whose prompt logprob is still to collect."""
        if self.needs_prompt_logprobs:
            return self.next_prompt_logprob_pos
        return self.total_len - 1

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.sampling.max_new_tokens - len(self.output_ids) - self.num_pending, 0)

    @property
    def speculates(self) -> bool:
        """Its decode steps may verify proposals: not opted out, and its sampling reads one
        position's logits at a time (penalties and logprobs read more; a grammar's masks are
        applied per verified position, speculation.grammar_masked)."""
        return self.sampling.speculative and self.penalties is None and self.logprob is None

    @property
    def needs_sync_sampling(self) -> bool:
        """Sampling reads the output so far (penalties, the grammar's mask) or returns logprobs:
        the overlap loop runs such a step without overlap, so that state is never a token
        behind."""
        return self.penalties is not None or self.logprob is not None or self.grammar is not None
