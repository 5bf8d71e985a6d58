"""The fused decode layer computes what the layer computes op by op (torch's norm, products,
rotary embedding, SDPA over the paged K/V, SiLU), for float32 and int8 weights, serially and in
parallel; the engine takes it only where it can (CPU float32 activations, one tensor-parallel
rank). Its panels, packed for every weight: test_linear_kernels.py. Whole models, fused against
op by op and against transformers: test_model_parity.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from shoal.kernels import fused_decode
from shoal.kernels.interface import Attention, DecodeLayer, GatedMLP, Norm
from shoal.kernels.panel_products import Panels


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int8"])
def test_layer_matches_the_ops(quantized: bool, count: int, threads: int) -> None:
    torch.set_num_threads(count)
    assert fused_decode._agrees(quantized)


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int8"])
def test_runs_on_this_host(quantized: bool) -> None:
    """The path the engine takes by default on CPU: a host where it cannot run would silently run
    op by op, so the CI host proves it runs (its serial build in a forked child first)."""
    assert fused_decode.usable(quantized)
    assert fused_decode.enabled_for(torch.device("cpu"), torch.float32, 1, quantized)


@pytest.mark.parametrize("device, dtype, tp_size", [
    ("cuda", torch.float32, 1), ("cpu", torch.bfloat16, 1), ("cpu", torch.float32, 2)])
def test_not_enabled_elsewhere(device: str, dtype: torch.dtype, tp_size: int) -> None:
    assert not fused_decode.enabled_for(torch.device(device), dtype, tp_size, False)


def test_refuses_a_hidden_size_that_is_not_whole_panels() -> None:
    """Its outputs are written a panel at a time into the layer's [rows, hidden] buffers."""
    def panels(out: int, inp: int) -> Panels:
        return Panels.of(torch.randn(out, inp).numpy())

    norm, none = np.ones(24, np.float32), np.zeros(0, np.float32)
    with pytest.raises(ValueError, match="multiple of 16"):
        fused_decode.FusedLayer(norm, panels(48, 24), none, panels(24, 16), none, norm,
                                panels(64, 24), panels(24, 32))
    assert fused_decode.FusedLayer(norm[:16], panels(48, 16), none, panels(16, 16), none,
                                   norm[:16], panels(64, 16), panels(16, 32))


def _declared() -> DecodeLayer:
    """A Llama-form layer as a model declares it (its linears never read: refused first)."""
    norm = Norm(torch.ones(16), 1e-6)
    linear: Any = SimpleNamespace(weight=torch.nn.Parameter(torch.ones(16, 16)),
                                  linear_kernel=None)
    return DecodeLayer(input_norm=norm, qkv=linear, qkv_bias=None, o=linear, o_bias=None,
                       post_attention_norm=norm,
                       attention=Attention(heads=4, kv_heads=2, head_dim=8, rotary_dim=8,
                                           scale=8 ** -0.5),
                       mlp=GatedMLP(linear, linear))


@pytest.mark.parametrize("attention, layer, reason", [
    (dict(q_norm=Norm(torch.ones(8), 1e-6)), {}, "q/k norms"),
    (dict(sliding_window=4096), {}, "sliding-window"),
    (dict(logit_softcap=50.0), {}, "soft-capped"),
    (dict(rotary_dim=4), {}, "rotary embedding on part"),
    (dict(scale=0.25), {}, "score scale"),
    ({}, dict(mlp=None), "no dense gated MLP"),
    ({}, dict(other=("post-feedforward norm",)), "post-feedforward norm"),
])
def test_a_layer_declaring_what_the_kernel_does_not_compute_is_refused(
        attention: dict[str, Any], layer: dict[str, Any], reason: str) -> None:
    """Decided from the declaration alone: the model's decode then runs op by op (logged)."""
    plain = _declared()
    assert fused_decode.not_taken(plain) == []
    declared = dataclasses.replace(
        plain, attention=dataclasses.replace(plain.attention, **attention), **layer)
    assert any(reason in what for what in fused_decode.not_taken(declared))
    with pytest.raises(ValueError, match=f"layer 1 has .*{reason}"):
        fused_decode.FusedDecode.of([plain, declared])


def test_a_gelu_mlp_is_refused() -> None:
    plain = _declared()
    assert plain.mlp is not None
    gelu = dataclasses.replace(plain, mlp=dataclasses.replace(plain.mlp, activation="gelu_tanh"))
    assert fused_decode.not_taken(gelu) == ["an MLP activation other than SiLU"]
