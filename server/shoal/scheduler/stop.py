"""Finish conditions, checked after every sampled token: stop tokens, stop strings, lengths."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from shoal.ipc.messages import FinishReason
from shoal.scheduler.request import Req


class StopChecker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: set[int],
                 context_length: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length

    def check(self, req: Req) -> FinishReason | None:
        token = req.output_ids[-1]
        params = req.sampling
        if token in params.stop_token_ids or (
                not params.ignore_eos and token in self.eos_token_ids):
            return FinishReason(kind="stop", matched_token=token)
        if params.stop:
            matched = self._matched_stop_string(req)
            if matched is not None:
                return FinishReason(kind="stop", matched_str=matched)
        if len(req.output_ids) >= params.max_new_tokens or req.fill_len >= self.context_length:
            return FinishReason(kind="length")
        return None

    def _matched_stop_string(self, req: Req) -> str | None:
        # A stop string of k characters spans at most 4k tokens (byte-level tokens may each carry
        # one byte of a character), plus one token that may end just after it.
        window = 4 * max(len(s) for s in req.sampling.stop) + 1
        tail = self.tokenizer.decode(req.output_ids[-window:],
                                     skip_special_tokens=req.sampling.skip_special_tokens)
        for stop in req.sampling.stop:
            if stop in tail:
                return stop
        return None
