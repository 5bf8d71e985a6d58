"""What a checkpoint is, read from its HF config files: `ModelConfig` for the decoder families,
`BertConfig` for the embedding models, and `is_encoder_model` to tell them apart.

Torch-free, so that the api, the scheduler's setup and the router learn a model's facts without
importing the model code or the kernels (import-linter keeps it so). Both config layouts are
accepted: transformers v5 writes `rope_parameters` (theta and scaling in one dict); v4 writes
`rope_theta` and an optional `rope_scaling` dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Architectures whose q/k/v projections carry a bias regardless of `attention_bias`.
_QKV_BIAS_ARCHITECTURES = frozenset({"Qwen2ForCausalLM"})
_ROPE_TYPES = ("default", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or feature shoal does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope: RopeConfig
    qkv_bias: bool
    o_proj_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> ModelConfig:
        path = Path(model_path)
        hf = json.loads((path / "config.json").read_text())
        generation_file = path / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.exists() else {}
        return cls.from_dicts(hf, generation)

    @classmethod
    def from_dicts(cls, hf: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
        architecture = (hf.get("architectures") or ["<none>"])[0]
        _check_supported(hf)
        try:
            return cls._from_checked(architecture, hf, generation)
        except KeyError as missing:
            raise UnsupportedModelError(
                f"{architecture} config lacks the field {missing}") from None

    @classmethod
    def _from_checked(cls, architecture: str, hf: dict[str, Any], generation: dict[str, Any]
                      ) -> ModelConfig:
        num_heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=architecture,
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            vocab_size=hf["vocab_size"],
            max_position_embeddings=hf["max_position_embeddings"],
            rms_norm_eps=hf["rms_norm_eps"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope=_rope_config(hf),
            qkv_bias=attention_bias or architecture in _QKV_BIAS_ARCHITECTURES,
            o_proj_bias=attention_bias,
            bos_token_id=hf.get("bos_token_id", generation.get("bos_token_id")),
            eos_token_ids=_eos_token_ids(hf, generation),
        )


def _check_supported(hf: dict[str, Any]) -> None:
    unsupported = [
        (hf.get("hidden_act", "silu") != "silu", f"hidden_act={hf.get('hidden_act')!r}"),
        (bool(hf.get("mlp_bias", False)), "mlp_bias"),
        (bool(hf.get("use_sliding_window", False)), "sliding-window attention"),
    ]
    found = [what for bad, what in unsupported if bad]
    if found:
        raise UnsupportedModelError(f"unsupported model features: {', '.join(found)}")


def _rope_config(hf: dict[str, Any]) -> RopeConfig:
    if "rope_parameters" in hf:
        params = dict(hf["rope_parameters"] or {})
        theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    else:
        params = dict(hf.get("rope_scaling") or {})
        theta = hf.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise UnsupportedModelError(f"unsupported rope type {rope_type!r}; known: {_ROPE_TYPES}")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _eos_token_ids(hf: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (hf, generation):
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in ids:
                ids.append(token)
    return tuple(ids)


ENCODER_ARCHITECTURES = frozenset({"BertModel"})


def is_encoder_model(model_path: str | Path) -> bool:
    """Whether the checkpoint at `model_path` is an embedding model (`shoal.models.bert`)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    architectures = json.loads(config.read_text()).get("architectures") or []
    return bool(ENCODER_ARCHITECTURES.intersection(architectures))


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> BertConfig:
        raw = json.loads((Path(model_path) / "config.json").read_text())
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{model_path}: only absolute position embeddings are supported, "
                             f"not {raw['position_embedding_type']!r}")
        if raw.get("hidden_act", "gelu") not in ("gelu", "gelu_new"):
            raise ValueError(f"{model_path}: unsupported activation {raw['hidden_act']!r}")
        return cls(vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                   num_hidden_layers=raw["num_hidden_layers"],
                   num_attention_heads=raw["num_attention_heads"],
                   intermediate_size=raw["intermediate_size"],
                   max_position_embeddings=raw["max_position_embeddings"],
                   type_vocab_size=raw.get("type_vocab_size", 2),
                   layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
                   hidden_act=raw.get("hidden_act", "gelu"))
