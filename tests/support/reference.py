"""transformers as the reference the engine is compared against (float32, greedy)."""

from __future__ import annotations

from functools import lru_cache

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel


@lru_cache(maxsize=2)
def reference_model(path: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation that, like `ignore_eos`, does not stop at EOS."""
    model = reference_model(path)
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@torch.inference_mode()
def top2_logprob_gap(path: str, prefix_ids: list[int]) -> float:
    """Gap between the two most likely next tokens after `prefix_ids`."""
    logits = reference_model(path)(torch.tensor([prefix_ids])).logits[0, -1]
    top = torch.log_softmax(logits.float(), dim=-1).topk(2).values
    return float(top[0] - top[1])


def assert_same_or_tie(path: str, prompt_ids: list[int], expected: list[int],
                       actual: list[int]) -> None:
    """Token-for-token equal, except at a first divergence where the reference has a near tie."""
    if actual == expected:
        return
    n = min(len(actual), len(expected))
    first = next((i for i in range(n) if actual[i] != expected[i]), n)
    gap = top2_logprob_gap(path, prompt_ids + expected[:first])
    assert gap < 1e-3, (f"outputs diverge at token {first} where the reference's top-2 logprob "
                        f"gap is {gap:.2e} (not a tie):\nexpected {expected}\nactual   {actual}")
