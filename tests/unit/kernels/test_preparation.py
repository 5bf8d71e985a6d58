"""`shoal.kernels.prepare` decides from the settings and the model's declaration alone: decode
attention in place only where every declared layer's attention is what the kernel computes, and
with `--cpu-kernels torch` nothing but torch. Whole models through the model runner, both modes
against transformers: tests/unit/test_model_parity.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shoal.kernels import KernelArgs, ModelKernels, preparation, prepare
from shoal.kernels.interface import Attention, DecodeLayer, GatedMLP, Norm

CPU_FLOAT32 = KernelArgs("auto", torch.device("cpu"), torch.float32, 1)


def _linear() -> Any:
    return SimpleNamespace(weight=torch.nn.Parameter(torch.randn(16, 16), requires_grad=False),
                           linear_kernel=None)


def _layer(**attention: Any) -> DecodeLayer:
    norm = Norm(torch.ones(16), 1e-6)
    return DecodeLayer(input_norm=norm, qkv=_linear(), qkv_bias=None, o=_linear(), o_bias=None,
                       post_attention_norm=norm,
                       attention=dataclasses.replace(
                           Attention(heads=4, kv_heads=2, head_dim=8, rotary_dim=8,
                                     scale=8 ** -0.5), **attention),
                       mlp=GatedMLP(_linear(), _linear()))


def test_plain_attention_attends_in_place_on_cpu_float32() -> None:
    assert preparation._in_place_decode(CPU_FLOAT32, [_layer(), _layer()])


@pytest.mark.parametrize("args, layers", [
    (CPU_FLOAT32, [_layer(), _layer(sliding_window=64)]),
    (CPU_FLOAT32, [_layer(scale=0.25)]),
    (CPU_FLOAT32, [_layer(logit_softcap=50.0)]),
    (CPU_FLOAT32, None),
    (dataclasses.replace(CPU_FLOAT32, dtype=torch.bfloat16), [_layer()]),
    (dataclasses.replace(CPU_FLOAT32, device=torch.device("cuda")), [_layer()]),
], ids=["window", "scale", "softcap", "undeclared", "bfloat16", "cuda"])
def test_attention_the_kernel_does_not_compute_goes_through_sdpa(
        args: KernelArgs, layers: list[DecodeLayer] | None) -> None:
    assert not preparation._in_place_decode(args, layers)


def test_torch_mode_leaves_every_part_to_torch() -> None:
    layer = _layer()
    ops = SimpleNamespace(cpu_kernels=True)
    model: Any = SimpleNamespace(fused_decode=object(), greedy_head=object())
    model.kernel_spec = lambda: ModelKernels(linears=[layer.qkv, layer.o], layer_ops=[ops],
                                             decode_layers=[layer], lm_head=layer.o,
                                             vocab_size=16)
    weight = layer.qkv.weight
    prepared = prepare(model, dataclasses.replace(CPU_FLOAT32, mode="torch"))
    assert not prepared.in_place_decode
    assert model.fused_decode is None and model.greedy_head is None
    assert not ops.cpu_kernels
    assert layer.qkv.linear_kernel is None and layer.qkv.weight is weight
