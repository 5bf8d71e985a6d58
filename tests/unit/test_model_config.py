"""ModelConfig parsing (transformers v4 and v5 layouts), the registry, and the small pure helpers
of the model side: dtype/device resolution, layer ranges and shards."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shoal.engine.model_runner import resolve_device, resolve_dtype
from shoal.model_config import ModelConfig, RopeConfig, UnsupportedModelError
from shoal.models import get_model_class
from shoal.models.layers import head_shard
from shoal.models.parallel import ParallelGroup, pp_layer_range

_LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)


def _hf_config(**overrides: Any) -> dict[str, Any]:
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                rope_parameters=dict(rope_theta=100000.0, rope_type="default"))
    return {**base, **overrides}


def test_v5_layout() -> None:
    config = ModelConfig.from_dicts(_hf_config(), {"eos_token_id": [2, 7], "bos_token_id": 1})
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.rope == RopeConfig(theta=100000.0)
    assert config.eos_token_ids == (2, 7)
    assert config.bos_token_id == 1
    assert (config.tie_word_embeddings, config.qkv_bias, config.o_proj_bias) == (True, False, False)


def test_v4_and_v5_llama3_rope_agree() -> None:
    v5 = _hf_config(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0,
                                         **_LLAMA3_SCALING))
    v4 = _hf_config(rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", **_LLAMA3_SCALING))
    del v4["rope_parameters"]
    assert ModelConfig.from_dicts(v5, {}) == ModelConfig.from_dicts(v4, {})
    assert ModelConfig.from_dicts(v4, {}).rope == RopeConfig(
        theta=500000.0, rope_type="llama3", **_LLAMA3_SCALING)


def test_v4_layout_without_scaling_defaults() -> None:
    hf = _hf_config(rope_theta=10000.0, rope_scaling=None, head_dim=None, eos_token_id=None)
    del hf["rope_parameters"]
    config = ModelConfig.from_dicts(hf, {"eos_token_id": 0})
    assert config.rope == RopeConfig(theta=10000.0)
    assert config.head_dim == 64
    assert config.eos_token_ids == (0,)


def test_qwen2_has_qkv_bias_only() -> None:
    config = ModelConfig.from_dicts(_hf_config(architectures=["Qwen2ForCausalLM"]), {})
    assert (config.qkv_bias, config.o_proj_bias) == (True, False)
    assert get_model_class(config.architecture) is get_model_class("LlamaForCausalLM")


@pytest.mark.parametrize("overrides", [
    dict(rope_parameters=dict(rope_type="yarn", rope_theta=1.0, factor=4.0)),
    dict(hidden_act="gelu"),
    dict(use_sliding_window=True),
    dict(num_attention_heads=None),
])
def test_unsupported_configs_raise(overrides: dict[str, Any]) -> None:
    hf = {k: v for k, v in _hf_config(**overrides).items() if v is not None}
    with pytest.raises(UnsupportedModelError):
        ModelConfig.from_dicts(hf, {})


def test_unknown_architecture_raises() -> None:
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        get_model_class("GPT2LMHeadModel")


def test_resolve_dtype_and_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16
    with pytest.raises(ValueError):
        resolve_dtype("int8", cpu)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == cpu


@pytest.mark.parametrize("num_layers, pp_size, expected", [
    (30, 1, [(0, 30)]),
    (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),
    (2, 2, [(0, 1), (1, 2)]),
])
def test_pp_layer_range(num_layers: int, pp_size: int, expected: list[tuple[int, int]]) -> None:
    assert [pp_layer_range(num_layers, r, pp_size) for r in range(pp_size)] == expected


def test_pp_layer_range_rejects_more_stages_than_layers() -> None:
    with pytest.raises(ValueError):
        pp_layer_range(2, 0, 3)


@pytest.mark.parametrize("num_heads, num_kv_heads, tp_size, expected", [
    (16, 8, 4, [(0, 4, 0, 2), (4, 4, 2, 2), (8, 4, 4, 2), (12, 4, 6, 2)]),
    (8, 2, 4, [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]),  # KV heads replicated
    (4, 1, 2, [(0, 2, 0, 1), (2, 2, 0, 1)]),
    (9, 3, 2, [(0, 6, 0, 2), (6, 3, 2, 1)]),  # SmolLM2: whole GQA groups, unevenly
    (9, 1, 2, [(0, 5, 0, 1), (5, 4, 0, 1)]),
])
def test_head_shard(num_heads: int, num_kv_heads: int, tp_size: int,
                    expected: list[tuple[int, int, int, int]]) -> None:
    shards = [head_shard(num_heads, num_kv_heads, ParallelGroup(rank, tp_size))
              for rank in range(tp_size)]
    assert [(s.q_start, s.num_heads, s.kv_start, s.num_kv_heads) for s in shards] == expected
    assert sum(s.num_heads for s in shards) == num_heads


def test_impossible_head_shards_raise() -> None:
    with pytest.raises(ValueError):
        head_shard(6, 2, ParallelGroup(0, 3))  # 2 KV heads cannot be replicated over 3 ranks
    with pytest.raises(ValueError):
        head_shard(2, 1, ParallelGroup(0, 4))  # more ranks than query heads
    with pytest.raises(ValueError):
        ParallelGroup(0, 2).shard(9)


def test_gemma_v4_layouts_alternate_window_and_global_layers() -> None:
    """Without `layer_types`, transformers' rules: Gemma 2 alternates from a window layer,
    Gemma 3 puts a global layer after every five window layers, its local rope from
    rope_local_base_freq."""
    gemma2 = _hf_config(architectures=["Gemma2ForCausalLM"], num_hidden_layers=4,
                        sliding_window=4096, hidden_activation="gelu_pytorch_tanh",
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                        query_pre_attn_scalar=256)
    config = ModelConfig.from_dicts(gemma2, {})
    assert config.layer_windows == (4096, None, 4096, None)
    assert (config.hidden_act, config.attn_logit_softcapping) == ("gelu_pytorch_tanh", 50.0)
    assert config.attention_scale == 256 ** -0.5
    gemma3 = _hf_config(architectures=["Gemma3ForCausalLM"], num_hidden_layers=7,
                        sliding_window=512, rope_theta=1e6, rope_local_base_freq=1e4,
                        rope_scaling=dict(rope_type="linear", factor=8.0))
    del gemma3["rope_parameters"]
    config = ModelConfig.from_dicts(gemma3, {})
    assert config.layer_windows == (512,) * 5 + (None, 512)
    assert config.rope == RopeConfig(theta=1e6, rope_type="linear", factor=8.0)
    assert config.local_rope == RopeConfig(theta=1e4)


@pytest.mark.parametrize(("overrides", "windows"), [
    (dict(sliding_window=4096), (4096, 4096)),  # Mistral: every layer
    (dict(sliding_window=None), (None, None)),
    (dict(sliding_window=64, use_sliding_window=False), (None, None)),  # Qwen: off
    (dict(sliding_window=64, use_sliding_window=True, max_window_layers=1), (None, 64)),
    (dict(sliding_window=64, layer_types=["full_attention", "sliding_attention"]), (None, 64)),
])
def test_sliding_window_layers(overrides: dict[str, Any], windows: tuple[int | None, ...]
                               ) -> None:
    hf = _hf_config(architectures=["MistralForCausalLM"], num_hidden_layers=2, **overrides)
    assert ModelConfig.from_dicts(hf, {}).layer_windows == windows


def test_moe_and_longrope_configs() -> None:
    qwen2_moe = _hf_config(architectures=["Qwen2MoeForCausalLM"], num_hidden_layers=3,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=64, mlp_only_layers=[1])
    moe = ModelConfig.from_dicts(qwen2_moe, {}).moe
    assert moe is not None
    assert (moe.num_experts, moe.top_k, moe.norm_topk_prob) == (8, 2, False)
    assert moe.sparse_layers == (True, False, True)
    phi3 = _hf_config(architectures=["Phi3ForCausalLM"], max_position_embeddings=131072,
                      original_max_position_embeddings=4096, rope_theta=1e4,
                      rope_scaling=dict(type="su", short_factor=[1.0] * 32,
                                        long_factor=[2.0] * 32))
    del phi3["rope_parameters"]
    rope = ModelConfig.from_dicts(phi3, {}).rope
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == (
        "longrope", 32.0, 4096)
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


@pytest.mark.parametrize(("overrides", "field"), [
    (dict(quantization_config=dict(quant_method="awq")), "quantization_config"),
    (dict(layer_types=["full_attention"] * 29 + ["chunked_attention"]), "layer_types"),
    (dict(use_sliding_window=True, max_window_layers=0), "sliding_window"),
    (dict(hidden_act="relu2"), "hidden_act"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1.0, factor=4.0)), "rope_type"),
])
def test_unsupported_features_name_their_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dicts(_hf_config(**overrides), {})
