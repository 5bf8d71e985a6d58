"""The `tenants` dataset of `shoal bench serving`: several tenants, each with its own system
prompt, and requests that each start with their tenant's prompt then a question of their own.

It is the workload a cache-aware router is for (docs/pd.md): the system prompts are long and
the questions short, so a request served where its tenant's prompt is cached computes a small
part of its prompt; one sent elsewhere computes it all.
"""

from __future__ import annotations

from shoal.bench.datasets import Prompt, PromptMaker


def tenant_prompts(maker: PromptMaker, num_prompts: int, num_tenants: int, prefix_len: int,
                   suffix_len: int, output_len: int) -> list[Prompt]:
    """`num_tenants` system prompts of `prefix_len` tokens; request i belongs to a tenant drawn
    at random and adds a unique `suffix_len`-token question."""
    systems = [maker.text(prefix_len) for _ in range(num_tenants)]
    prompts = []
    for _ in range(num_prompts):
        text = maker.rng.choice(systems) + maker.text(suffix_len)
        prompts.append(Prompt(text, maker.count(text), output_len))
    return prompts
