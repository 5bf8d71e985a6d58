"""Tiny random-weight checkpoints of each model family, built with transformers' own classes and
saved as users have them: sharded safetensors with an index, the default model's tokenizer and
chat template (so the vocabulary matches), and a generation config.

transformers is imported inside functions only: spawned test workers import this module.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

SLIDING_WINDOW = 8  # far below the prompts' lengths, so the window layers' masks matter
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja")
_COMMON: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=False)
_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                 short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                 long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
                 original_max_position_embeddings=512)
# family -> (transformers model_type, config overrides, dtype the checkpoint is saved in)
FAMILIES: dict[str, tuple[str, dict[str, Any], torch.dtype]] = {
    "qwen3": ("qwen3", {}, torch.bfloat16),
    "mistral": ("mistral", dict(sliding_window=SLIDING_WINDOW), torch.float32),
    "gemma2": ("gemma2", dict(sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=24,
                              tie_word_embeddings=True), torch.float32),
    "gemma3": ("gemma3_text", dict(
        sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0))), torch.float32),
    "phi3": ("phi3", dict(rope_parameters=_LONGROPE, original_max_position_embeddings=512),
             torch.float16),
    "qwen2-moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                    mlp_only_layers=[1]), torch.float32),
    "qwen3-moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, norm_topk_prob=True),
                  torch.bfloat16),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=SLIDING_WINDOW), torch.float32),
}
# the families the issue names, each served in tests/integration/test_model_families.py; the
# other MoE families share qwen2-moe's code and are checked in process
SERVED = ("gemma2", "gemma3", "mistral", "phi3", "qwen2-moe", "qwen3")


def randomize_weights(model: torch.nn.Module) -> None:
    """Weights drawn large enough (std 0.2, norms around 1) that greedy argmaxes are rarely
    near-ties (the seed is the caller's)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)


def build(family: str, target: Path, tokenizer_dir: Path) -> Path:
    """A random-weight checkpoint of `family` in `target` (`randomize_weights`), saved sharded
    in the family's dtype with `tokenizer_dir`'s tokenizer files."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    model_type, overrides, dtype = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **{**_COMMON, **overrides})
    torch.manual_seed(sorted(FAMILIES).index(family))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 0], do_sample=True,
                                               temperature=0.7, top_p=0.9)
    model.to(dtype).save_pretrained(target, max_shard_size="2MB")
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, target / name)
    return target
