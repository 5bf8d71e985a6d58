"""Our own model implementations, looked up by the checkpoint's `architectures[0]`.

Every family in `shoal.models.families` runs on the generic decoder; a Llama or Qwen2
checkpoint that uses nothing beyond Llama's layers runs on the Llama model, whose decode steps
the fused decode kernel takes.
"""

from __future__ import annotations

from shoal.models.config import ModelConfig, UnsupportedModelError
from shoal.models.decoder import DecoderForCausalLM
from shoal.models.families import FAMILIES
from shoal.models.llama import LlamaForCausalLM

ModelClass = type[LlamaForCausalLM] | type[DecoderForCausalLM]
# Qwen2 is Llama plus a q/k/v bias, which ModelConfig.qkv_bias carries.
_LLAMA_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM"})
SUPPORTED_ARCHITECTURES = tuple(sorted(FAMILIES))


def get_model_class(architecture: str) -> ModelClass:
    if architecture not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture!r}; "
            f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    return LlamaForCausalLM if architecture in _LLAMA_ARCHITECTURES else DecoderForCausalLM


def model_class_for(config: ModelConfig) -> ModelClass:
    """The class that serves `config`: the Llama model where its layers are Llama's."""
    model_class = get_model_class(config.architecture)
    if model_class is LlamaForCausalLM and not _llama_layers(config):
        return DecoderForCausalLM
    return model_class


def _llama_layers(config: ModelConfig) -> bool:
    return (not any(config.layer_windows) and config.local_rope is None
            and config.rope.rope_type in ("default", "llama3")
            and config.rope.partial_rotary_factor == 1.0 and config.hidden_act == "silu"
            and config.query_pre_attn_scalar is None and config.attn_logit_softcapping is None
            and config.final_logit_softcapping is None and config.moe is None)


__all__ = ["SUPPORTED_ARCHITECTURES", "DecoderForCausalLM", "LlamaForCausalLM", "ModelConfig",
           "UnsupportedModelError", "get_model_class", "model_class_for"]
