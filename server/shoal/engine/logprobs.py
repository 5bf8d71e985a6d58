"""Log-probabilities of chosen tokens and their top alternatives.

They are the `log_softmax` of the raw float32 logits the model returns: before temperature,
penalties, logit_bias and top-k/top-p/min-p filtering (what OpenAI reports, and SGLang with
SGLANG_RETURN_ORIGINAL_LOGPROB), so they do not depend on how a token was sampled.
"""

from __future__ import annotations

import torch

from shoal.ipc.messages import TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int) -> TokenLogprobs:
    """Row i of `logits` [k, vocab] scores `token_ids[i]`; with `top_n`, also the `top_n` most
    likely tokens of each row."""
    return batch_logprobs(logits, token_ids, [top_n] * len(token_ids))


def batch_logprobs(logits: torch.Tensor, token_ids: list[int],
                   top_ns: list[int]) -> TokenLogprobs:
    """Like `token_logprobs`, with its own number of alternatives per row (all 0: none)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device).unsqueeze(1)
    out = TokenLogprobs(logprobs=logprobs.gather(1, ids).squeeze(1).tolist())
    most = max(top_ns, default=0)
    if most > 0:
        values, indices = logprobs.topk(min(most, logprobs.shape[-1]), dim=-1)
        values_list, indices_list = values.tolist(), indices.tolist()
        out.top_ids = [row[:n] for row, n in zip(indices_list, top_ns)]
        out.top_logprobs = [row[:n] for row, n in zip(values_list, top_ns)]
    return out
