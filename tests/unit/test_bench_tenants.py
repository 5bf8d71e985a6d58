"""`shoal bench serving --dataset tenants`: each tenant's own system prompt, then a question of
the request's own; the prefix cache hit rate from the server's `usage`."""

from __future__ import annotations

import random

from shoal import model_store
from shoal.bench.datasets import PromptMaker, load_tokenizer
from shoal.bench.serving import RequestOutput, summarize
from shoal.bench.tenants import tenant_prompts


def test_each_request_starts_with_one_of_the_tenants_system_prompts() -> None:
    maker = PromptMaker(load_tokenizer(str(model_store.prepare())), random.Random(1))
    prompts = tenant_prompts(maker, 40, 4, 200, 10, 3)
    ids = [maker.tokenizer.encode(p.text, add_special_tokens=False) for p in prompts]
    assert all(len(i) == 210 and p.num_tokens == 210 and p.output_len == 3
               for i, p in zip(ids, prompts))
    systems = {tuple(i[:200]) for i in ids}
    assert len(systems) == 4  # every tenant asked, each with its own system prompt
    assert len({tuple(i[200:]) for i in ids}) == 40


def test_the_hit_rate_is_cached_over_prompt_tokens() -> None:
    outputs = [RequestOutput(ok=True, e2e_s=1.0, prompt_tokens=100, completion_tokens=2,
                             cached_tokens=cached) for cached in (0, 90, 95)]
    outputs.append(RequestOutput(ok=False, prompt_tokens=100, cached_tokens=100))  # failed
    assert summarize(outputs, 1.0, [2] * 4)["cache_hit_rate"] == (0 + 90 + 95) / 300
