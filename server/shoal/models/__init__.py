"""Our own model implementations, looked up by the checkpoint's `architectures[0]`."""

from __future__ import annotations

from shoal.model_config import UnsupportedModelError
from shoal.models.llama import LlamaForCausalLM

# Qwen2 is Llama plus a q/k/v bias, which ModelConfig.qkv_bias carries.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    if architecture not in MODEL_REGISTRY:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture!r}; supported: {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "get_model_class"]
