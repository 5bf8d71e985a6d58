"""Building blocks shared by the decoder models, tensor-parallel where they hold big weights.

Every layer that owns weights has `load_weight(param, source, shard)`: it narrows the checkpoint
tensor `source` to this rank's share and copies it into parameter `param`. `shard` names the
checkpoint part of a fused weight ("q"/"k"/"v", "gate"/"up") and is None otherwise.

Parameters are created with `torch.empty`, so build models under the target device and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shoal.kernels import layer_kernels
from shoal.kernels.interface import LinearProduct, Norm
from shoal.models.loader import TensorSlice, read_cols, read_rows
from shoal.models.parallel import ParallelGroup


def _parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class Linear(nn.Module):
    """A layer whose `weight` [out, in] takes part in matrix products (a
    `shoal.kernels.interface.KernelLinear`). They run through `linear_kernel`, which
    `shoal.kernels.prepare` sets once the weights are loaded (the stored layout, quantization and
    kernels measured on this host); until then, and with `--cpu-kernels torch`, they are
    `F.linear`."""

    weight: nn.Parameter
    linear_kernel: LinearProduct | None = None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.linear_kernel
        return F.linear(x, self.weight) if kernel is None else kernel(x)


def _add_bias(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias


class RMSNorm(nn.Module):
    """`cpu_kernels`: computed by `shoal.kernels.layer_kernels` (a
    `shoal.kernels.interface.LayerOps`, set by `shoal.kernels.prepare`)."""

    cpu_kernels = False

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = _parameter(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels:
            return layer_kernels.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm residual step."""
        if self.cpu_kernels:
            return layer_kernels.add_rms_norm(x, residual, self.weight, self.eps)
        x = x + residual
        return self.forward(x), x

    def load_weight(self, param: str, source: TensorSlice, shard: str | None) -> None:
        self.weight.copy_(source[:])

    def declared(self) -> Norm:
        return Norm(self.weight, self.eps)


@dataclass(frozen=True)
class HeadShard:
    """The query heads [q_start, q_start + num_heads) and KV heads [kv_start, kv_start +
    num_kv_heads) one rank holds. Local query head i always reads local KV head
    i // (num_heads // num_kv_heads), so attention's GQA grouping is unchanged."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def head_shard(num_heads: int, num_kv_heads: int, tp: ParallelGroup) -> HeadShard:
    """Split whole GQA groups over the ranks, as evenly as they go (9 heads in 3 groups over 2
    ranks: 6 and 3). With fewer KV heads than ranks, each KV head is replicated on
    tp / num_kv_heads ranks, which split that head's query group between them."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp.size:
        kv_start, kv_count = _balanced(num_kv_heads, tp.size, tp.rank)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if tp.size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated over {tp.size} ranks")
    ranks_per_kv_head = tp.size // num_kv_heads
    if ranks_per_kv_head > group:
        raise ValueError(f"{num_heads} query heads cannot be split over {tp.size} ranks")
    kv_head = tp.rank // ranks_per_kv_head
    q_offset, q_count = _balanced(group, ranks_per_kv_head, tp.rank % ranks_per_kv_head)
    return HeadShard(kv_head * group + q_offset, q_count, kv_head, 1)


def _balanced(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when `total` items go to `parts`, the first ones larger."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


class QKVParallelLinear(Linear):
    """Fused q/k/v projection. Each rank owns a contiguous block of query heads and the KV
    heads they read; when there are fewer KV heads than ranks, each KV head is replicated."""

    def __init__(self, hidden_size: int, head_dim: int, heads: HeadShard, bias: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        q_size = heads.num_heads * head_dim
        kv_size = heads.num_kv_heads * head_dim
        # shard -> (offset in the fused weight, start in the checkpoint tensor, size)
        self._shards = {
            "q": (0, heads.q_start * head_dim, q_size),
            "k": (q_size, heads.kv_start * head_dim, kv_size),
            "v": (q_size + kv_size, heads.kv_start * head_dim, kv_size),
        }
        out_features = q_size + 2 * kv_size
        self.weight = _parameter(out_features, hidden_size)
        self.bias = _parameter(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]: query, key and value heads."""
        return _add_bias(self.product(x), self.bias)

    def load_weight(self, param: str, source: TensorSlice, shard: str | None) -> None:
        assert shard is not None
        offset, start, size = self._shards[shard]
        getattr(self, param)[offset:offset + size].copy_(read_rows(source, start, size))


class GateUpParallelLinear(Linear):
    """Fused gate and up projections, split along the intermediate dimension."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: ParallelGroup) -> None:
        super().__init__()
        self.start, self.size = tp.shard(intermediate_size)
        self.weight = _parameter(2 * self.size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

    def load_weight(self, param: str, source: TensorSlice, shard: str | None) -> None:
        assert shard in ("gate", "up")
        offset = 0 if shard == "gate" else self.size
        self.weight[offset:offset + self.size].copy_(read_rows(source, self.start, self.size))


class RowParallelLinear(Linear):
    """Split along the input dimension; partial outputs are summed across ranks. `in_shard`
    (start, size) overrides the even split, e.g. to follow an uneven split of attention heads."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: ParallelGroup,
                 in_shard: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.size = in_shard or tp.shard(in_features)
        self.weight = _parameter(out_features, self.size)
        self.bias = _parameter(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _add_bias(self.tp.all_reduce(self.product(x)), self.bias)

    def load_weight(self, param: str, source: TensorSlice, shard: str | None) -> None:
        if param == "bias":
            assert self.bias is not None
            self.bias.copy_(source[:])
        else:
            self.weight.copy_(read_cols(source, self.start, self.size))


class VocabParallelEmbedding(Linear):
    """Each rank holds ceil(vocab / tp) rows; the last rank's tail rows are zero padding."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: ParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        rows = -(-vocab_size // tp.size)
        self.start = tp.rank * rows
        self.end = min(self.start + rows, vocab_size)
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        owned = (input_ids >= self.start) & (input_ids < self.end)
        out = self._lookup((input_ids - self.start) * owned)
        return self.tp.all_reduce(out * owned[:, None])

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        kernel = self.linear_kernel
        return F.embedding(ids, self.weight) if kernel is None else kernel.rows(ids)

    def load_weight(self, param: str, source: TensorSlice, shard: str | None) -> None:
        rows = self.end - self.start
        self.weight[:rows].copy_(read_rows(source, self.start, rows))


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-sharded output projection; every rank ends up with the full logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(self.product(hidden), dim=-1)
        return logits[:, :self.vocab_size]
