"""Our model implementation, looked up by the checkpoint's `architectures[0]`: the generic
decoder (`shoal.models.decoder`) for every family `shoal.models.families` describes."""

from __future__ import annotations

from shoal.model_config import UnsupportedModelError
from shoal.models.decoder import DecoderForCausalLM
from shoal.models.families import FAMILIES

SUPPORTED_ARCHITECTURES = tuple(sorted(FAMILIES))


def get_model_class(architecture: str) -> type[DecoderForCausalLM]:
    if architecture not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture!r}; "
            f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    return DecoderForCausalLM


__all__ = ["SUPPORTED_ARCHITECTURES", "DecoderForCausalLM", "get_model_class"]
