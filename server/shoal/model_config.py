"""What a checkpoint is, read from its HF config files: `ModelConfig` for the decoder families,
`BertConfig` for the embedding models, and `is_encoder_model` to tell them apart.

Torch-free, so that the api, the scheduler's setup and the router learn a model's facts without
importing the model code or the kernels (import-linter keeps it so). Both config layouts are
accepted: transformers v5 writes `rope_parameters` (theta and scaling in one dict, or one dict
per layer type) and `layer_types`; v4 writes `rope_theta` and an optional `rope_scaling` dict,
and leaves the sliding-window layers to per-family rules (reproduced in `_default_layer_types`).
Anything the engine does not implement raises `UnsupportedModelError` naming the config field,
never a model that computes something else.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Architectures whose q/k/v projections carry a bias regardless of `attention_bias`.
_QKV_BIAS_ARCHITECTURES = frozenset({"Qwen2ForCausalLM", "Qwen2MoeForCausalLM"})
_ROPE_TYPES = ("default", "llama3", "linear", "longrope")
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_LAYER_TYPES = ("full_attention", "sliding_attention")
_GEMMA2 = "Gemma2ForCausalLM"
_GEMMA3 = "Gemma3ForCausalLM"


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or feature shoal does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # one of _ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # longrope (Phi-3): per-frequency divisors below / from original_max_position_embeddings,
    # and the factor cos and sin are scaled by
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    partial_rotary_factor: float = 1.0  # the leading share of each head's dims that rotates


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: each token's `top_k` experts of `num_experts` (softmax over the
    router's logits, renormalized over the chosen when `norm_topk_prob`), plus a shared expert
    gated by a sigmoid where `shared_expert_intermediate_size` > 0. `sparse_layers[i]`: layer i
    has the experts (else a dense MLP of `ModelConfig.intermediate_size`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int
    sparse_layers: tuple[bool, ...]


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
    hidden_act: str = "silu"
    # per layer: the sliding window (a query at position i sees keys i - window < j <= i) or None
    layer_windows: tuple[int | None, ...] = ()
    local_rope: RopeConfig | None = None  # the sliding layers' rope where it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    moe: MoeConfig | None = None

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

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    @classmethod
    def _from_checked(cls, architecture: str, hf: dict[str, Any], generation: dict[str, Any]
                      ) -> ModelConfig:
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        attention_bias = bool(hf.get("attention_bias", False))
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope, local_rope = _rope_configs(architecture, hf, head_dim)
        return cls(
            architecture=architecture,
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            vocab_size=hf["vocab_size"],
            max_position_embeddings=hf["max_position_embeddings"],
            rms_norm_eps=hf["rms_norm_eps"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope=rope,
            qkv_bias=(attention_bias or bool(hf.get("qkv_bias", False))
                      or architecture in _QKV_BIAS_ARCHITECTURES),
            o_proj_bias=attention_bias,
            bos_token_id=hf.get("bos_token_id", generation.get("bos_token_id")),
            eos_token_ids=_eos_token_ids(hf, generation),
            hidden_act=_activation(hf),
            layer_windows=_layer_windows(architecture, hf, num_layers),
            local_rope=local_rope,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            moe=_moe_config(hf, num_layers),
        )


def _activation(hf: dict[str, Any]) -> str:
    return str(hf.get("hidden_activation") or hf.get("hidden_act") or "silu")


def _check_supported(hf: dict[str, Any]) -> None:
    unsupported = [
        (_activation(hf) not in _ACTIVATIONS, f"hidden_act={_activation(hf)!r}"),
        (bool(hf.get("mlp_bias", False)), "mlp_bias"),
        (bool(hf.get("use_bidirectional_attention")), "use_bidirectional_attention"),
        ("quantization_config" in hf,
         f"quantization_config (a {(hf.get('quantization_config') or {}).get('quant_method')}"
         " checkpoint; shoal loads float weights and quantizes with --quantization)"),
    ]
    found = [what for bad, what in unsupported if bad]
    if found:
        raise UnsupportedModelError(f"unsupported model features: {', '.join(found)}")


def _default_layer_types(architecture: str, hf: dict[str, Any], num_layers: int) -> list[str]:
    """transformers' own rules for configs written without `layer_types` (v4)."""
    sliding, full = _LAYER_TYPES[1], _LAYER_TYPES[0]
    if architecture == _GEMMA2:
        return [sliding if (i + 1) % 2 else full for i in range(num_layers)]
    if architecture == _GEMMA3:
        pattern = hf.get("sliding_window_pattern", 6)
        return [sliding if (i + 1) % pattern else full for i in range(num_layers)]
    if "use_sliding_window" in hf:  # the Qwen families: layers from max_window_layers on
        first = hf.get("max_window_layers", 0) if hf["use_sliding_window"] else num_layers
        return [sliding if i >= first else full for i in range(num_layers)]
    return [sliding if hf.get("sliding_window") else full] * num_layers


def _layer_windows(architecture: str, hf: dict[str, Any], num_layers: int
                   ) -> tuple[int | None, ...]:
    layer_types = hf.get("layer_types") or _default_layer_types(architecture, hf, num_layers)
    if len(layer_types) != num_layers or any(t not in _LAYER_TYPES for t in layer_types):
        raise UnsupportedModelError(
            f"layer_types {layer_types!r}: expected {num_layers} of {_LAYER_TYPES}")
    window = hf.get("sliding_window")
    if _LAYER_TYPES[1] not in layer_types:
        return (None,) * num_layers
    if not window:
        raise UnsupportedModelError(
            f"sliding_window={window!r} with sliding-window layers (layer_types or "
            "use_sliding_window); a positive window is needed")
    return tuple(int(window) if t == _LAYER_TYPES[1] else None for t in layer_types)


def _rope_configs(architecture: str, hf: dict[str, Any], head_dim: int
                  ) -> tuple[RopeConfig, RopeConfig | None]:
    """(the global rope, the sliding layers' rope where it differs)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and set(params) <= set(_LAYER_TYPES) and params:
        full = _rope_config(hf, params["full_attention"], head_dim)
        local = params.get("sliding_attention")
        return full, None if local is None else _rope_config(hf, local, head_dim)
    if params is not None:
        return _rope_config(hf, dict(params), head_dim), None
    scaling = dict(hf.get("rope_scaling") or {})
    scaling.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in hf:
        scaling.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    rope = _rope_config(hf, scaling, head_dim)
    if architecture == _GEMMA3:
        local_theta = hf.get("rope_local_base_freq", 10000.0)
        return rope, RopeConfig(theta=float(local_theta))
    return rope, None


def _rope_config(hf: dict[str, Any], params: dict[str, Any], head_dim: int) -> RopeConfig:
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # early Phi-3 configs' name for longrope
        rope_type = "longrope"
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if rope_type not in _ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope_parameters.rope_type {rope_type!r}; known: {_ROPE_TYPES}")
    if int(head_dim * partial) % 2:
        raise UnsupportedModelError(
            f"partial_rotary_factor={partial} leaves an odd number of rotary dims")
    if rope_type == "default":
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type=rope_type, factor=float(params["factor"]),
                          partial_rotary_factor=partial)
    if rope_type == "longrope":
        return _longrope(hf, params, theta, partial)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        partial_rotary_factor=partial,
    )


def _longrope(hf: dict[str, Any], params: dict[str, Any], theta: float, partial: float
              ) -> RopeConfig:
    original = int(params.get("original_max_position_embeddings")
                   or hf["original_max_position_embeddings"])
    factor = params.get("factor") or hf["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    return RopeConfig(theta=theta, rope_type="longrope", factor=float(factor),
                      original_max_position_embeddings=original,
                      short_factor=tuple(map(float, params["short_factor"])),
                      long_factor=tuple(map(float, params["long_factor"])),
                      attention_factor=float(attention_factor), partial_rotary_factor=partial)


def _moe_config(hf: dict[str, Any], num_layers: int) -> MoeConfig | None:
    num_experts = hf.get("num_experts") or hf.get("num_local_experts")
    if not num_experts:
        return None
    architecture = (hf.get("architectures") or [""])[0]
    mixtral = architecture == "MixtralForCausalLM"
    step = hf.get("decoder_sparse_step", 1) or 1
    dense = set(hf.get("mlp_only_layers") or [])
    return MoeConfig(
        num_experts=int(num_experts),
        top_k=int(hf["num_experts_per_tok"]),
        intermediate_size=int(hf["intermediate_size"] if mixtral
                              else hf["moe_intermediate_size"]),
        norm_topk_prob=mixtral or bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
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
