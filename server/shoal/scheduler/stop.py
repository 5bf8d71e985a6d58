"""Finish conditions, checked after every sampled token: stop tokens, stop strings, lengths.

Before `min_new_tokens` tokens exist nothing but the length limit stops a request (sampling masks
EOS and stop tokens meanwhile). A stop string let through then can still sit in the decoded tail
later on; only an occurrence that the newest token completes stops the request, and the finish
says how many occurrences came before it, so the detokenizer cuts the text at the right one.
"""

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
        if len(req.output_ids) >= params.min_new_tokens:
            if token in params.stop_token_ids or (
                    not params.ignore_eos and token in self.eos_token_ids):
                return FinishReason(kind="stop", matched_token=token)
            if params.stop:
                finish = self._matched_stop_string(req)
                if finish is not None:
                    return finish
        if len(req.output_ids) >= params.max_new_tokens or req.total_len >= self.context_length:
            return FinishReason(kind="length")
        return None

    def _matched_stop_string(self, req: Req) -> FinishReason | None:
        # A stop string of k characters spans at most 4k tokens (byte-level tokens may each carry
        # one byte of a character), plus one token that may end just after it.
        ids = req.output_ids
        window = 4 * max(len(s) for s in req.sampling.stop) + 1
        tail = self._decode(req, ids[-window:])
        hits = [stop for stop in req.sampling.stop if stop in tail]
        if not hits:
            return None
        if max(len(ids) - window, 0) + 1 >= req.sampling.min_new_tokens:
            # the tail's tokens were all checked when they came: an occurrence is a new one; the
            # output ends at the one that starts first
            return FinishReason(kind="stop", matched_str=min(hits, key=tail.find))
        before = self._decode(req, ids[-window:-1])
        for stop in hits:
            if _count(tail, stop) > _count(before, stop):
                earlier = _count(self._decode(req, ids[:-1]), stop)
                return FinishReason(kind="stop", matched_str=stop, num_earlier_matches=earlier)
        return None

    def _decode(self, req: Req, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=req.sampling.skip_special_tokens)


def _count(text: str, stop: str) -> int:
    """Occurrences of `stop` in `text`, overlapping ones included."""
    count, at = 0, text.find(stop)
    while at >= 0:
        count, at = count + 1, text.find(stop, at + 1)
    return count
