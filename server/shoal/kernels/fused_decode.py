"""A decode step's decoder layers on the CPU, each layer one numba call.

At one decode row the products are what streaming the weights costs, yet a layer run op by op is ~40
torch ops and kernel calls, each with its dispatch, its tensor wrappers and its own parallel region;
at 16-64 rows the torch ops between the products (SiLU, the K/V writes, the norms' wrappers) and the
handing over between torch's OpenMP threads and numba's cost a share of the step too
(docs/cpu-kernels.md, measured in docs/perf-log.md). Here one call per layer computes the whole
layer for a decode batch of any size: residual add and RMSNorm, the fused q/k/v product (and its
bias), the rotary embedding, the new K/V written to their pool slots, attention over each request's
slots where they lie in the pool (`shoal.kernels.attention_tiles`), the output product, the second
norm, gate and up products, SiLU-and-multiply, and the down product, in six parallel regions
(products a panel of output channels per task, attention over rows and KV heads, SiLU over rows),
with an exp of its own that vectorizes.

The products read each weight's panels (`shoal.kernels.panel_products`, the copy packed at load
for the panel kernels: float32 or int8 with a float32 scale per channel; at every row count from
one, as fast as or faster than shoal's other kernels on the row-major weight), in tiles of up to
six rows with AVX2, 24 with AVX-512, each product's input in rows padded to
`panel_products.row_width`. Prefill chunks, tensor parallelism and anything not
float32 on the CPU run the layers op by op. The kernel sums in another order than torch, as
every float32 kernel of the engine may.

Compiled by numba (`shoal.kernels.numba_kernels`: serial and parallel builds, cached; the first
compile is long). `enabled_for` says where the engine may use it: where its serial build runs in
a forked child and it agrees with the layer computed op by op on a small random layer;
`FusedDecode.of` takes the layers a model declares (`not_taken`: what it does not compute).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np
import torch
import torch.nn.functional as F

from shoal.kernels import decode_attention
from shoal.kernels.attention_tiles import attend_group
from shoal.kernels.interface import DecodeLayer, KernelLinear, PagedDecode
from shoal.kernels.kernel_probe import runs_and_agrees
from shoal.kernels.linear_kernels import LinearKernel
from shoal.kernels.numba_kernels import Twins, exp_in_place
from shoal.kernels.panel_products import PANEL, TILE_ROWS, Panels, panel_rows, row_width
from shoal.kernels.quantization import dequantize, quantize_per_channel
from shoal.kernels.rotary import apply_rotary

# The probe child's limit: its serial build compiles in ~10-30 s the first time on two cores
# (the cache serves later loads), longer on a busy host.
_FIRST_COMPILE_S = 180.0
_NO_BIAS = np.zeros(0, np.float32)

# Helpers inlined into the kernel (numba IR), so compiled with its options.
_inline = numba.njit(inline="always")
_row_width = _inline(row_width)


@_inline
def _rms_norm_row(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    total = np.float32(0.0)
    for j in range(x.shape[0]):
        total += x[j] * x[j]
    scale = np.float32(1.0) / np.sqrt(total / np.float32(x.shape[0]) + eps)
    for j in range(x.shape[0]):
        out[j] = x[j] * scale * weight[j]


def _decode_layer(hidden: np.ndarray, residual: np.ndarray, first: bool, eps: np.float32,
                  norm1: np.ndarray, qkv_w: np.ndarray, qkv_scale: np.ndarray,
                  qkv_bias: np.ndarray, cos: np.ndarray, sin: np.ndarray, heads: int,
                  kv_heads: int, k_pool: np.ndarray, v_pool: np.ndarray, table: np.ndarray,
                  req_rows: np.ndarray, seq_lens: np.ndarray, out_cache_loc: np.ndarray,
                  o_w: np.ndarray, o_scale: np.ndarray, o_bias: np.ndarray,
                  norm2: np.ndarray, gu_w: np.ndarray, gu_scale: np.ndarray,
                  down_w: np.ndarray, down_scale: np.ndarray,
                  out: np.ndarray, summed: np.ndarray) -> None:
    """One decoder layer for decode rows hidden [m, size] (and residual, unless `first`):
    out = the MLP's output, summed = the residual after attention (the layer's `(hidden,
    residual)`). Row r is the next token of request `req_rows[r]` at position seq_lens[r] - 1;
    its K/V go to slot out_cache_loc[r]. The weights are panels (`Panels.weights` and
    `.scale`); `size` is a multiple of `PANEL` (the other products' outputs are padded)."""
    rows, size = hidden.shape
    dim = k_pool.shape[2]
    group = heads // kv_heads
    attn_scale = np.float32(1.0) / np.float32(np.sqrt(np.float32(dim)))

    # input norm (and the residual add), row by row
    normed = np.empty((rows, _row_width(size)), np.float32)
    for m in numba.prange(rows):
        if first:
            summed[m] = hidden[m]
        else:
            for j in range(size):
                summed[m, j] = hidden[m, j] + residual[m, j]
        _rms_norm_row(summed[m], norm1, eps, normed[m])

    # q/k/v
    qkv = np.empty((rows, qkv_w.shape[0] * PANEL), np.float32)
    for panel in numba.prange(qkv_w.shape[0]):
        panel_rows(qkv_w, normed, qkv_scale, qkv, panel)

    # bias, rotary embedding on q and k heads, K/V into the pool
    half = dim // 2
    for m in numba.prange(rows):
        for j in range(qkv_bias.shape[0]):
            qkv[m, j] += qkv_bias[j]
        for h in range(heads + kv_heads):
            base = h * dim
            for i in range(half):
                a = qkv[m, base + i]
                b = qkv[m, base + i + half]
                qkv[m, base + i] = a * cos[m, i] + b * sin[m, i]
                qkv[m, base + i + half] = b * cos[m, i + half] + a * sin[m, i + half]
        slot = out_cache_loc[m]
        for h in range(kv_heads):
            for d in range(dim):
                k_pool[slot, h, d] = qkv[m, (heads + h) * dim + d]
                v_pool[slot, h, d] = qkv[m, (heads + kv_heads + h) * dim + d]

    # attention, one (row, KV head) a task: each K/V row read once for the query heads of its
    # group
    attn = np.empty((rows, _row_width(heads * dim)), np.float32)
    for task in numba.prange(rows * kv_heads):
        m = task // kv_heads
        attend_group(qkv, k_pool, v_pool, table, req_rows[m], m, task % kv_heads, seq_lens[m],
                     group, attn_scale, attn)

    # output product
    projected = np.empty((rows, size), np.float32)
    for panel in numba.prange(o_w.shape[0]):
        panel_rows(o_w, attn, o_scale, projected, panel)

    # post-attention norm (and the residual add)
    for m in numba.prange(rows):
        for j in range(size):
            value = projected[m, j] + summed[m, j]
            if o_bias.shape[0]:
                value += o_bias[j]
            summed[m, j] = value
        _rms_norm_row(summed[m], norm2, eps, normed[m])

    # gate and up (gate's channels first), then SiLU(gate) * up row by row
    inner = down_w.shape[1]
    gate_up = np.empty((rows, gu_w.shape[0] * PANEL), np.float32)
    for panel in numba.prange(gu_w.shape[0]):
        panel_rows(gu_w, normed, gu_scale, gate_up, panel)
    act = np.empty((rows, _row_width(inner)), np.float32)
    for m in numba.prange(rows):
        e = -gate_up[m, :inner]
        exp_in_place(e, np.empty(inner, np.int32))
        for j in range(inner):
            act[m, j] = gate_up[m, j] / (np.float32(1.0) + e[j]) * gate_up[m, inner + j]

    # down product
    for panel in numba.prange(down_w.shape[0]):
        panel_rows(down_w, act, down_scale, out, panel)


_kernel = Twins(_decode_layer)


def _panels(linear: KernelLinear) -> Panels:
    kernel = linear.linear_kernel
    assert isinstance(kernel, LinearKernel), "the linear kernels are prepared first"
    return kernel.stored.pack_panels()


def _array(tensor: torch.Tensor | None) -> np.ndarray:
    return _NO_BIAS if tensor is None else tensor.detach().numpy()


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's weights as the kernel reads them (a missing bias: an empty array)."""

    norm1: np.ndarray
    qkv: Panels
    qkv_bias: np.ndarray
    o: Panels
    o_bias: np.ndarray
    norm2: np.ndarray
    gate_up: Panels
    down: Panels

    def __post_init__(self) -> None:
        gate_up_channels = self.gate_up.channels
        if self.o.channels % PANEL or self.down.channels != self.o.channels or (
                gate_up_channels % 2 or gate_up_channels // 2 != self.down.weights.shape[1]):
            raise ValueError(f"the fused decode needs a hidden size that is a multiple of "
                             f"{PANEL} and gate / up halves as wide as the down product's input")

    @classmethod
    def of(cls, layer: DecodeLayer) -> FusedLayer:
        """From a layer the kernel takes (`not_taken` empty) whose linear kernels are prepared
        (its weights' panels packed now where no kernel packed them)."""
        assert layer.mlp is not None
        return cls(norm1=_array(layer.input_norm.weight), qkv=_panels(layer.qkv),
                   qkv_bias=_array(layer.qkv_bias), o=_panels(layer.o),
                   o_bias=_array(layer.o_bias), norm2=_array(layer.post_attention_norm.weight),
                   gate_up=_panels(layer.mlp.gate_up), down=_panels(layer.mlp.down))


def not_taken(layer: DecodeLayer) -> list[str]:
    """What of a declared layer this kernel does not compute (empty: it takes the layer)."""
    attention, mlp = layer.attention, layer.mlp
    checks = [
        (attention.rotary_dim != attention.head_dim, "rotary embedding on part of each head"),
        (attention.q_norm is not None or attention.k_norm is not None, "q/k norms"),
        (mlp is None, "no dense gated MLP"),
        (mlp is not None and mlp.activation != "silu", "an MLP activation other than SiLU"),
        (layer.input_norm.eps != layer.post_attention_norm.eps, "norms of different eps"),
    ]
    return (decode_attention.not_taken(attention)
            + [what for missing, what in checks if missing] + list(layer.other))


class FusedDecode:
    """Decoder layers (one pipeline stage's) for decode batches, one kernel call per layer."""

    def __init__(self, layers: list[FusedLayer], heads: int, kv_heads: int, eps: float) -> None:
        self.layers = layers
        self.heads, self.kv_heads = heads, kv_heads
        self.eps = np.float32(eps)

    @classmethod
    def of(cls, layers: Sequence[DecodeLayer]) -> FusedDecode:
        """The kernel over declared layers whose linear kernels are prepared; ValueError naming
        what it does not take where it does not take every layer alike."""
        if not layers:
            raise ValueError("no decoder layers declared")
        for index, layer in enumerate(layers):
            missing = not_taken(layer)
            if missing:
                raise ValueError(f"layer {index} has {', '.join(missing)}")
        first = layers[0]
        shape = (first.attention.heads, first.attention.kv_heads, first.input_norm.eps)
        if any((layer.attention.heads, layer.attention.kv_heads, layer.input_norm.eps) != shape
               for layer in layers):
            raise ValueError("layers of different head counts or norm eps")
        return cls([FusedLayer.of(layer) for layer in layers], *shape)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, paged: PagedDecode) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on decode rows hidden [rows, size] (residual None before the first
        layer): the (hidden, residual) the layers run op by op return; cos / sin [rows, 1,
        head_dim] as the model's rotary embedding gives them."""
        rows = hidden.shape[0]
        cos_a, sin_a = cos.reshape(rows, -1).numpy(), sin.reshape(rows, -1).numpy()
        shared = (paged.table.numpy(), paged.rows.numpy(), paged.seq_lens.numpy(),
                  paged.out_cache_loc.numpy())
        x = hidden.contiguous().numpy()
        r = x if residual is None else residual.contiguous().numpy()
        first = residual is None
        for layer, k_pool, v_pool in zip(self.layers, paged.k, paged.v):
            out, summed = np.empty_like(x), np.empty_like(x)
            _kernel.run(x, r, first, self.eps, layer.norm1, layer.qkv.weights, layer.qkv.scale,
                        layer.qkv_bias, cos_a, sin_a, self.heads, self.kv_heads, k_pool.numpy(),
                        v_pool.numpy(), *shared, layer.o.weights, layer.o.scale, layer.o_bias,
                        layer.norm2, layer.gate_up.weights, layer.gate_up.scale,
                        layer.down.weights, layer.down.scale, out, summed)
            x, r, first = out, summed, False
        return torch.from_numpy(x), torch.from_numpy(r)


def enabled_for(device: torch.device, dtype: torch.dtype, tp_size: int, quantized: bool
                ) -> bool:
    """Whether a model of these settings runs its decode steps fused: CPU float32
    activations, one tensor-parallel rank, and the kernel runs here."""
    return (device.type == "cpu" and dtype == torch.float32 and tp_size == 1
            and usable(quantized))


@functools.cache
def usable(quantized: bool) -> bool:
    """Whether the kernel's build for float32 (or int8) weights runs here (its serial build
    first in a forked child) and agrees with the layer computed op by op on a small case."""
    return runs_and_agrees("fused-decode-int8" if quantized else "fused-decode",
                           functools.partial(_agrees, quantized), _FIRST_COMPILE_S)


# -- the agreement check: a small random layer against torch's ops ---------------------------


def _agrees(quantized: bool) -> bool:
    gen = torch.Generator().manual_seed(0)
    size, heads, kv_heads, dim, inner = 32, 9, 3, 8, 46
    eps = 1e-6

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.3

    def weight(out: int, inp: int) -> tuple[torch.Tensor, Panels]:
        w = randn(out, inp)
        if quantized:
            q, scale = quantize_per_channel(w)
            return dequantize(q, scale), Panels.of(q.numpy(), scale.numpy())
        return w, Panels.of(w.numpy())

    norm1, norm2 = randn(size) + 1, randn(size) + 1
    qkv_w, qkv = weight((heads + 2 * kv_heads) * dim, size)
    o_w, o = weight(size, heads * dim)
    gu_w, gate_up = weight(2 * inner, size)
    down_w, down = weight(size, inner)
    qkv_bias, o_bias = randn(qkv_w.shape[0]), randn(size)
    layer = FusedLayer(norm1.numpy(), qkv, qkv_bias.numpy(), o, o_bias.numpy(), norm2.numpy(),
                       gate_up, down)

    # a whole tile of rows and two more; requests in another order than the rows, contexts of 1
    # to 12 tokens; q/k/v and gate / up not a whole number of panels (their outputs padded)
    count = TILE_ROWS + 2
    requests, slots = count + 2, (count + 2) * 12 + 40
    k_pool, v_pool = randn(slots, kv_heads, dim), randn(slots, kv_heads, dim)
    table = torch.randperm(slots, generator=gen)[:requests * 12].view(requests, 12)
    rows = torch.randperm(requests, generator=gen)[:count]
    seq_lens = torch.randint(1, 13, (count,), generator=gen)
    out_cache_loc = table[rows, seq_lens - 1]
    hidden, residual = randn(count, size), randn(count, size)
    angles = (seq_lens - 1)[:, None].float() * torch.tensor([1.0, 0.1, 0.01, 0.001])
    cos = torch.cat((angles, angles), dim=-1)[:, None].cos()
    sin = torch.cat((-angles, angles), dim=-1)[:, None].sin()

    # torch's ops, as the layers run them one by one
    summed = hidden + residual
    x = F.linear(F.rms_norm(summed, (size,), norm1, eps), qkv_w) + qkv_bias
    x = x.view(count, -1, dim)
    turned = apply_rotary(x[:, :heads + kv_heads], cos, sin)
    q, k, v = turned[:, :heads], turned[:, heads:], x[:, heads + kv_heads:]
    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    ref_k[out_cache_loc], ref_v[out_cache_loc] = k, v
    attended = torch.stack([F.scaled_dot_product_attention(
        q[r][:, None], ref_k[table[rows[r], :seq_lens[r]]].transpose(0, 1),
        ref_v[table[rows[r], :seq_lens[r]]].transpose(0, 1), enable_gqa=True)[:, 0]
        for r in range(count)])
    summed = F.linear(attended.flatten(1), o_w) + o_bias + summed
    gate, up = F.linear(F.rms_norm(summed, (size,), norm2, eps), gu_w).chunk(2, dim=-1)
    expected = F.linear(F.silu(gate) * up, down_w)

    fused = FusedDecode([layer], heads, kv_heads, eps)
    out, got_summed = fused.forward(hidden, residual, cos, sin, PagedDecode(
        [k_pool], [v_pool], table, rows, seq_lens, out_cache_loc))
    return (torch.allclose(out, expected, atol=1e-4, rtol=1e-3)
            and torch.allclose(got_summed, summed, atol=1e-4, rtol=1e-3)
            and torch.allclose(k_pool, ref_k, atol=1e-5)
            and torch.allclose(v_pool, ref_v, atol=1e-5))
