"""What the CPU kernels read of a model: the one contract between `shoal.models` and
`shoal.kernels`.

A model declares itself through `KernelModel.kernel_spec()`, a `ModelKernels`;
`shoal.kernels.prepare` reads nothing else of it (no attribute names) and hands back what it
chose by setting the model's `fused_decode` and `greedy_head`. A kernel takes a part of the model
only where the declaration says that part computes exactly what the kernel computes: a decoder
layer whose `DecodeLayer` states a feature a kernel does not take (q/k norms, a sliding window,
soft-capping, another activation, no dense MLP, anything in `other`) runs through torch, and the
reason is logged. Whatever a model leaves out of its declaration stays torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import nn

from shoal.config import CpuKernels


@dataclass(frozen=True)
class KernelArgs:
    """The settings the kernels are chosen for: `mode` "torch" rules every kernel out (plain
    torch everywhere); `quantization` "w8a16" stores the linear weights as int8;
    `threads` (base, large forward) are the torch threads products run with (None: the
    current count)."""

    mode: CpuKernels
    device: torch.device
    dtype: torch.dtype
    tp_size: int
    quantization: str = "none"
    threads: tuple[int, int] | None = None


class LinearProduct(Protocol):
    """A weight's products as a kernel computes them."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out] float, as `F.linear(x, weight)`."""
        ...

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the logical weight, dequantized (an embedding lookup)."""
        ...


class KernelLinear(Protocol):
    """A layer whose `weight` [out, in] takes part in matrix products. `prepare` may move the
    weight into another stored form (the parameter then holds that tensor, its logical shape
    kept, int8 when quantized) and sets `linear_kernel`; while that is None the layer computes
    `F.linear` (and `F.embedding` for a lookup)."""

    weight: nn.Parameter
    linear_kernel: LinearProduct | None


class LayerOps(Protocol):
    """A module whose small steps (RMSNorm and its residual add, the rotary embedding in place)
    run `shoal.kernels.layer_kernels` while `cpu_kernels` is True, torch's ops otherwise."""

    cpu_kernels: bool


@dataclass(frozen=True)
class Norm:
    """An RMSNorm: x / sqrt(mean(x ** 2) + eps) * weight."""

    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class Attention:
    """A layer's attention as this rank computes it: query head h (of `heads`) reads KV head
    h // (heads // kv_heads), each `head_dim` wide; scores scaled by `scale`; the rotate-half
    rotary embedding (`shoal.kernels.rotary.apply_rotary`) on the first `rotary_dim` values of
    every q and k head. The optional features are what some families add: per-head RMSNorms of
    q and k before the rotary embedding, attention to the last `sliding_window` positions only,
    scores soft-capped as cap * tanh(score / cap)."""

    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    scale: float
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    sliding_window: int | None = None
    logit_softcap: float | None = None


Activation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class GatedMLP:
    """down(act(gate) * up), gate and up one fused product `gate_up` (gate's channels first)."""

    gate_up: KernelLinear
    down: KernelLinear
    activation: Activation = "silu"


@dataclass(frozen=True)
class DecodeLayer:
    """One decoder layer in pre-norm residual form, as this rank computes it:

        h   = x + o(attention(rotary(qkv(input_norm(x)) + qkv_bias))) + o_bias
        out = h + mlp(post_attention_norm(h))

    where qkv's output is [q heads | k heads | v heads] x head_dim (a missing bias: None).
    `mlp` None: not a dense gated MLP (e.g. a mixture of experts). `other` names whatever else
    the layer computes that this form does not state (e.g. "post-feedforward norm"): a kernel
    that takes whole layers leaves such a layer to torch."""

    input_norm: Norm
    qkv: KernelLinear
    qkv_bias: torch.Tensor | None
    o: KernelLinear
    o_bias: torch.Tensor | None
    post_attention_norm: Norm
    attention: Attention
    mlp: GatedMLP | None
    other: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelKernels:
    """What one rank's model (one pipeline stage) declares to the kernels.

    linears: every layer with matrix products (a tied weight may appear under two layers);
    layer_ops: the modules whose small steps the layer kernels may compute;
    decode_layers: this stage's decoder layers in order, or None where the model does not
        describe them (its decode steps then run op by op);
    lm_head: the last stage's LM head (the logits are its products with the final hidden
        states), None on other stages; the first `vocab_size` rows of its weight are the
        vocabulary, any after them padding."""

    linears: Sequence[KernelLinear]
    layer_ops: Sequence[LayerOps]
    decode_layers: Sequence[DecodeLayer] | None
    lm_head: KernelLinear | None
    vocab_size: int


@dataclass(frozen=True)
class PagedDecode:
    """A decode batch's K/V where they lie, for a kernel that writes and reads them in place:
    per layer the pool buffers k / v [slots, kv_heads, head_dim], the request -> token table,
    and per row its request's row of the table, its sequence length (the new token included)
    and its new token's slot. The attention backend lends it (`paged_decode()`)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    table: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor


class DecodeRunner(Protocol):
    """A decode step's decoder layers computed by a kernel (`shoal.kernels.fused_decode`)."""

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, paged: PagedDecode) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on decode rows hidden [rows, size] (residual None before the first
        layer): the (hidden, residual) the layers run op by op return."""
        ...


class GreedyLogits(Protocol):
    """An LM head for steps that read only each row's argmax (`shoal.kernels.greedy_head`)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab]: each row's exact logits where its largest can be, -inf elsewhere."""
        ...


class KernelModel(Protocol):
    """A model the kernels prepare: it declares itself (`kernel_spec`) and runs what `prepare`
    sets, where set: its decode steps' layers through `fused_decode` when the attention backend
    lends the K/V in place, its greedy steps' LM head through `greedy_head`."""

    fused_decode: DecodeRunner | None
    greedy_head: GreedyLogits | None

    def kernel_spec(self) -> ModelKernels: ...
