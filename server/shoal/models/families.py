"""What sets each decoder family apart, as data the generic decoder (`shoal.models.decoder`)
reads: the numbers come from the checkpoint's config (`ModelConfig`), the structure from here.

To add a family whose layers are a combination of these: one `Family` entry in `FAMILIES`,
keyed by the checkpoint's `architectures[0]`, and a parity test (tests/unit/test_model_families.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """qk_norm: q and k RMS-normed per head before rope (Qwen3, Gemma 3).
    gemma: Gemma's layer: RMSNorm weights stored as offsets from 1 (the norm multiplies by
    1 + w), a norm after attention and after the MLP as well as before each, embeddings scaled
    by sqrt(hidden_size).
    fused_checkpoint: the checkpoint stores q/k/v as one `qkv_proj` and gate/up as one
    `gate_up_proj` (Phi-3).
    moe_block / expert_names: the checkpoint's name of the mixture-of-experts module and of an
    expert's gate, up and down projections (Mixtral: `block_sparse_moe`, w1 w3 w2)."""

    qk_norm: bool = False
    gemma: bool = False
    fused_checkpoint: bool = False
    moe_block: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Qwen3ForCausalLM": Family(qk_norm=True),
    "Gemma2ForCausalLM": Family(gemma=True),
    "Gemma3ForCausalLM": Family(gemma=True, qk_norm=True),
    "Phi3ForCausalLM": Family(fused_checkpoint=True),
    "Qwen2MoeForCausalLM": Family(),
    "Qwen3MoeForCausalLM": Family(qk_norm=True),
    "MixtralForCausalLM": Family(moe_block="block_sparse_moe", expert_names=("w1", "w3", "w2")),
}
