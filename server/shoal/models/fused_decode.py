"""A few-row decode step's decoder layers on the CPU, each layer one numba call.

At one decode row the products are what streaming the weights costs, yet a layer run op by op
is ~40 torch ops and kernel calls, each with its dispatch, its tensor wrappers and its own
parallel region: on a 2-core AMD EPYC a one-stream step took 28.7 ms op by op and 22.2 ms fused
in float32, 15.9 and 8.6 ms in w8a16 (docs/benchmarks.md). Here one call per layer computes
the whole layer for a decode batch of up to `MAX_ROWS` rows: residual add and RMSNorm, the
fused q/k/v product (and its bias), the rotary embedding, the new K/V written to their pool
slots, attention over each request's slots where they lie in the pool, the output product, the
second norm, gate and up products with SiLU-and-multiply as they are summed, and the down
product, in six parallel regions (products over groups of output channels, attention over
rows and KV heads, SiLU over rows), with an exp of its own that vectorizes.

The products read the weights as `shoal.models.linear_kernels` stores them for a model that
runs fused (row-major: each output channel a dot product, four rows at a time), float32 or int8
with a float32 scale per channel. Larger batches, prefill chunks, tensor parallelism and
anything not float32 on the CPU run the layers op by op. The kernel sums in another order than
torch, as every float32 kernel of the engine may.

Compiled by numba (`shoal.models.numba_kernels`: serial and parallel builds, cached; ~15-30 s
the first time on two cores). `enabled_for` says where the engine uses it: where its serial build
runs in a forked child and it agrees with the layer computed op by op on a small random layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numba
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shoal.models.attention_backend import PagedDecode
from shoal.models.kernel_probe import runs_and_agrees
from shoal.models.layers import apply_rotary
from shoal.models.linear_kernels import LinearKernel
from shoal.models.numba_kernels import Twins, exp_in_place, prefetch_ahead
from shoal.models.numba_products import four_by_three
from shoal.models.quantization import dequantize, quantize_per_channel

# Decode batches of up to this many rows (the row buckets whose products run on the base thread
# count, `shoal.models.linear_kernels.LARGE_FORWARD_TOKENS`); larger ones run op by op.
MAX_ROWS = 11
# The probe child's limit: its serial build compiles in ~10-30 s the first time on two cores
# (the cache serves later loads), longer on a busy host.
_FIRST_COMPILE_S = 180.0
# Output channels a parallel task computes.
_GROUP = 4
_NO_BIAS = np.zeros(0, np.float32)

# Helpers inlined into the kernel (numba IR), so compiled with its options.
_inline = numba.njit(inline="always")


@_inline
def _rms_norm_row(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    total = np.float32(0.0)
    for j in range(x.shape[0]):
        total += x[j] * x[j]
    scale = np.float32(1.0) / np.sqrt(total / np.float32(x.shape[0]) + eps)
    for j in range(x.shape[0]):
        out[j] = x[j] * scale * weight[j]


@_inline
def _channel(x: np.ndarray, w: np.ndarray, n: int, scale: np.float32, out: np.ndarray,
             col: int, first_row: int) -> None:
    """out[m, col] = (x[m] . w[n]) * scale for rows m from `first_row`, four rows at a time
    (each weight load feeds four sums), the last rows one at a time."""
    rows, depth = x.shape
    wn = w[n]
    m = first_row
    while m + 4 <= rows:
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for k in range(depth):
            wk = np.float32(wn[k])
            a0 += x[m, k] * wk
            a1 += x[m + 1, k] * wk
            a2 += x[m + 2, k] * wk
            a3 += x[m + 3, k] * wk
        out[m, col] = a0 * scale
        out[m + 1, col] = a1 * scale
        out[m + 2, col] = a2 * scale
        out[m + 3, col] = a3 * scale
        m += 4
    while m < rows:
        a0 = np.float32(0.0)
        for k in range(depth):
            a0 += x[m, k] * np.float32(wn[k])
        out[m, col] = a0 * scale
        m += 1


@_inline
def _channels(x: np.ndarray, w: np.ndarray, n: int, count: int, scale: np.ndarray,
              out: np.ndarray, col: int) -> None:
    """out[:, col + c] = (x . w[n + c]) * scale[n + c] for c < count (at most `_GROUP`): with a
    full group and several rows, four channels and three rows at a time
    (`numba_products.four_by_three`; a step of many rows is bound by its multiply-adds), the
    rows left over and a lone row a channel at a time."""
    rows = x.shape[0]
    m = 0
    if count == _GROUP:
        while m + 3 <= rows:
            four_by_three(x, w, n, m, scale, out, col)
            m += 3
    for c in range(count):
        _channel(x, w, n + c, scale[n + c], out, col + c, m)


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
    its K/V go to slot out_cache_loc[r]."""
    rows, size = hidden.shape
    dim = k_pool.shape[2]
    group = heads // kv_heads
    attn_scale = np.float32(1.0) / np.float32(np.sqrt(np.float32(dim)))

    # input norm (and the residual add), row by row
    normed = np.empty((rows, size), np.float32)
    for m in range(rows):
        if first:
            summed[m] = hidden[m]
        else:
            for j in range(size):
                summed[m, j] = hidden[m, j] + residual[m, j]
        _rms_norm_row(summed[m], norm1, eps, normed[m])

    # q/k/v
    qkv = np.empty((rows, (heads + 2 * kv_heads) * dim), np.float32)
    width = qkv_w.shape[0]
    for g in numba.prange((width + _GROUP - 1) // _GROUP):
        n = g * _GROUP
        _channels(normed, qkv_w, n, min(_GROUP, width - n), qkv_scale, qkv, n)

    # bias, rotary embedding on q and k heads, K/V into the pool
    half = dim // 2
    for m in range(rows):
        if qkv_bias.shape[0]:
            for j in range(qkv.shape[1]):
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
    attn = np.empty((rows, heads * dim), np.float32)
    for task in numba.prange(rows * kv_heads):
        m = task // kv_heads
        kv = task % kv_heads
        n = seq_lens[m]
        slots = table[req_rows[m]]
        first_q = kv * group * dim
        scores = np.empty((group, n), np.float32)
        for t in range(n):
            prefetch_ahead(k_pool, slots, t, n, kv)
            k_t = k_pool[slots[t], kv]
            for g in range(group):
                start = first_q + g * dim
                acc = np.float32(0.0)
                for d in range(dim):
                    acc += qkv[m, start + d] * k_t[d]
                scores[g, t] = acc * attn_scale
        bits = np.empty(n, np.int32)
        for g in range(group):
            s = scores[g]
            s -= s.max()
            exp_in_place(s, bits)
            s /= s.sum()
        o = attn[m, first_q:first_q + group * dim]
        o[:] = 0.0
        for t in range(n):
            prefetch_ahead(v_pool, slots, t, n, kv)
            v_t = v_pool[slots[t], kv]
            for g in range(group):
                p = scores[g, t]
                start = g * dim
                for d in range(dim):
                    o[start + d] += p * v_t[d]

    # output product
    projected = np.empty((rows, size), np.float32)
    for g in numba.prange((size + _GROUP - 1) // _GROUP):
        n = g * _GROUP
        _channels(attn, o_w, n, min(_GROUP, size - n), o_scale, projected, n)

    # post-attention norm (and the residual add)
    for m in range(rows):
        for j in range(size):
            value = projected[m, j] + summed[m, j]
            if o_bias.shape[0]:
                value += o_bias[j]
            summed[m, j] = value
        _rms_norm_row(summed[m], norm2, eps, normed[m])

    # gate and up, a group of channels of each a task, then SiLU(gate) * up row by row
    inner = gu_w.shape[0] // 2
    act = np.empty((rows, inner), np.float32)
    up = np.empty((rows, inner), np.float32)
    for g in numba.prange((inner + _GROUP - 1) // _GROUP):
        j = g * _GROUP
        count = min(_GROUP, inner - j)
        _channels(normed, gu_w, j, count, gu_scale, act, j)
        _channels(normed, gu_w, inner + j, count, gu_scale, up, j)
    for m in numba.prange(rows):
        e = -act[m]
        exp_in_place(e, np.empty(inner, np.int32))
        for j in range(inner):
            act[m, j] = act[m, j] / (np.float32(1.0) + e[j]) * up[m, j]

    # down product
    for g in numba.prange((size + _GROUP - 1) // _GROUP):
        n = g * _GROUP
        _channels(act, down_w, n, min(_GROUP, size - n), down_scale, out, n)


_kernel = Twins(_decode_layer)


@dataclass(frozen=True)
class _Weight:
    """A product's weight as the kernel reads it: `array` row-major [out, in] (float32 or int8)
    and the scale per output channel (ones for float32)."""

    array: np.ndarray
    scale: np.ndarray

    @classmethod
    def of(cls, weight: torch.Tensor, scale: torch.Tensor | None) -> _Weight:
        """From a stored weight (`shoal.models.linear_kernels.StoredWeight`): the row-major
        [out, in] tensor and an int8 weight's scales."""
        if not weight.is_contiguous():
            raise ValueError("the fused decode reads row-major weights")
        return cls(weight.numpy(),
                   np.ones(weight.shape[0], np.float32) if scale is None else scale.numpy())

    @classmethod
    def of_kernel(cls, kernel: LinearKernel | None) -> _Weight:
        assert kernel is not None, "the linear kernels are prepared before the fused decode"
        return cls.of(kernel.stored.weight, kernel.stored.scale)


def _array(tensor: torch.Tensor | None) -> np.ndarray:
    return _NO_BIAS if tensor is None else tensor.detach().numpy()


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's weights as the kernel reads them (a missing bias: an empty array)."""

    norm1: np.ndarray
    qkv: _Weight
    qkv_bias: np.ndarray
    o: _Weight
    o_bias: np.ndarray
    norm2: np.ndarray
    gate_up: _Weight
    down: _Weight

    @classmethod
    def of(cls, layer: nn.Module) -> FusedLayer:
        """From a `shoal.models.llama.LlamaDecoderLayer` whose linear kernels are prepared."""
        attn, mlp = layer.self_attn, layer.mlp
        return cls(norm1=_array(layer.input_layernorm.weight),
                   qkv=_Weight.of_kernel(attn.qkv_proj.linear_kernel),
                   qkv_bias=_array(attn.qkv_proj.bias),
                   o=_Weight.of_kernel(attn.o_proj.linear_kernel), o_bias=_array(attn.o_proj.bias),
                   norm2=_array(layer.post_attention_layernorm.weight),
                   gate_up=_Weight.of_kernel(mlp.gate_up_proj.linear_kernel),
                   down=_Weight.of_kernel(mlp.down_proj.linear_kernel))


class FusedDecode:
    """Decoder layers (one pipeline stage's) for decode batches of up to `MAX_ROWS` rows, one
    kernel call per layer."""

    def __init__(self, layers: list[FusedLayer], heads: int, kv_heads: int, eps: float) -> None:
        self.layers = layers
        self.heads, self.kv_heads = heads, kv_heads
        self.eps = np.float32(eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, paged: PagedDecode) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on decode rows hidden [rows, size] (residual None before the first
        layer): the (hidden, residual) the layers run op by op return; cos / sin [rows, 1,
        head_dim] as `RotaryEmbedding.cos_sin` gives them."""
        rows = hidden.shape[0]
        cos_a, sin_a = cos.reshape(rows, -1).numpy(), sin.reshape(rows, -1).numpy()
        shared = (paged.table.numpy(), paged.rows.numpy(), paged.seq_lens.numpy(),
                  paged.out_cache_loc.numpy())
        x = hidden.contiguous().numpy()
        r = x if residual is None else residual.contiguous().numpy()
        first = residual is None
        for layer, k_pool, v_pool in zip(self.layers, paged.k, paged.v):
            out, summed = np.empty_like(x), np.empty_like(x)
            _kernel.run(x, r, first, self.eps, layer.norm1, layer.qkv.array, layer.qkv.scale,
                        layer.qkv_bias, cos_a, sin_a, self.heads, self.kv_heads, k_pool.numpy(),
                        v_pool.numpy(), *shared, layer.o.array, layer.o.scale, layer.o_bias,
                        layer.norm2, layer.gate_up.array, layer.gate_up.scale,
                        layer.down.array, layer.down.scale, out, summed)
            x, r, first = out, summed, False
        return torch.from_numpy(x), torch.from_numpy(r)


def enabled_for(device: torch.device, dtype: torch.dtype, tp_size: int, quantized: bool
                ) -> bool:
    """Whether a model of these settings runs its few-row decode steps fused: CPU float32
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
    size, heads, kv_heads, dim, inner = 32, 4, 2, 8, 46
    eps = 1e-6

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.3

    def weight(out: int, inp: int) -> tuple[torch.Tensor, _Weight]:
        w = randn(out, inp)
        if quantized:
            q, scale = quantize_per_channel(w)
            return dequantize(q, scale), _Weight.of(q, scale)
        return w, _Weight.of(w, None)

    norm1, norm2 = randn(size) + 1, randn(size) + 1
    qkv_w, qkv = weight((heads + 2 * kv_heads) * dim, size)
    o_w, o = weight(size, heads * dim)
    gu_w, gate_up = weight(2 * inner, size)
    down_w, down = weight(size, inner)
    qkv_bias, o_bias = randn(qkv_w.shape[0]), randn(size)
    layer = FusedLayer(norm1.numpy(), qkv, qkv_bias.numpy(), o, o_bias.numpy(), norm2.numpy(),
                       gate_up, down)

    # eight rows: two blocks of three and two alone in the products of four channels at a time,
    # two blocks of four in the last two channels of gate and up (`inner` is 4k + 2)
    slots, count = 160, 8
    k_pool, v_pool = randn(slots, kv_heads, dim), randn(slots, kv_heads, dim)
    table = torch.randperm(slots, generator=gen)[:120].view(10, 12)
    rows = torch.tensor([2, 0, 5, 1, 3, 9, 7, 8])
    seq_lens = torch.tensor([12, 5, 1, 9, 7, 12, 2, 3])
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
