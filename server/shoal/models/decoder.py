"""The generic decoder: one model class for every family in `shoal.models.families`, its layers
chosen by the family's `Family` and the checkpoint's `ModelConfig`.

A layer is RMSNorm -> rotary GQA attention (q/k head norms, a sliding window, a scale and a
score cap where the config has them) -> RMSNorm -> MLP (SwiGLU or GeGLU, or a mixture of
experts), with Gemma's extra norms after attention and after the MLP. Tensor parallelism splits
heads and the MLP's intermediate dimension as in the Llama model; a pipeline stage builds the
layers [start_layer, end_layer) only. Checkpoint names (`model.layers.{i}.self_attn.q_proj.weight`)
map to this stage's local layers and fused projections in `load_weight`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from shoal.kernels import layer_kernels
from shoal.kernels.greedy_head import MAX_ROWS
from shoal.kernels.interface import (
    Activation,
    Attention,
    DecodeLayer,
    DecodeRunner,
    GatedMLP,
    GreedyLogits,
    ModelKernels,
)
from shoal.model_config import ModelConfig
from shoal.models.attention_backend import AttentionBackend, LayerAttention
from shoal.models.families import FAMILIES, Family
from shoal.models.forward_batch import ForwardBatch
from shoal.models.layers import (
    GateUpParallelLinear,
    Linear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    head_shard,
)
from shoal.models.loader import TensorSlice
from shoal.models.moe import SparseMoe
from shoal.models.parallel import ParallelGroup
from shoal.models.rotary import Rotary

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}
_DECLARED_ACTIVATIONS: dict[str, Activation] = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# checkpoint projection -> (our fused projection, shard)
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
Rope = dict[bool, tuple[torch.Tensor, torch.Tensor]]  # local (sliding layer's rope)? -> cos, sin


class _WeightOwner(Protocol):
    def load_weight(self, param: str, source: TensorSlice, shard: str | None) -> None: ...


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm multiplies by 1 + w: the weight is stored as 1 + w when loaded."""

    def load_weight(self, param: str, source: TensorSlice, shard: str | None) -> None:
        self.weight.copy_(source[:].float() + 1)


class HeadRMSNorm(RMSNorm):
    """RMSNorm over the last dimension of [tokens, heads, head_dim] (q / k per head)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class GemmaHeadRMSNorm(HeadRMSNorm, GemmaRMSNorm):
    pass


class _RowsFrom:
    """A checkpoint tensor's rows from `offset` on, read lazily (one part of a fused tensor)."""

    def __init__(self, source: TensorSlice, offset: int) -> None:
        self.source, self.offset = source, offset

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        assert isinstance(rows, slice) and rows.step is None and rows.stop is not None
        return self.source[(slice((rows.start or 0) + self.offset, rows.stop + self.offset),
                            *rest)]


class SelfAttention(nn.Module):
    """`cpu_kernels`: where the rotary embedding turns whole heads of q and k with no head norm
    before it, it does so in place in the q/k/v product's output
    (`shoal.kernels.layer_kernels`; a `shoal.kernels.interface.LayerOps`)."""

    cpu_kernels = False

    def __init__(self, config: ModelConfig, family: Family, layer: int, local: int,
                 tp: ParallelGroup, rotary: Rotary) -> None:
        super().__init__()
        self.layer_id = local
        self.head_dim = config.head_dim
        self.rotary = rotary
        heads = head_shard(config.num_heads, config.num_kv_heads, tp)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, heads,
                                          config.qkv_bias)
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, config.o_proj_bias, tp,
            in_shard=(heads.q_start * config.head_dim, heads.num_heads * config.head_dim))
        self.q_norm: HeadRMSNorm | None = None
        self.k_norm: HeadRMSNorm | None = None
        if family.qk_norm:
            norm = GemmaHeadRMSNorm if family.gemma else HeadRMSNorm
            self.q_norm = norm(config.head_dim, config.rms_norm_eps)
            self.k_norm = norm(config.head_dim, config.rms_norm_eps)
        window = config.layer_windows[layer] if config.layer_windows else None
        self.local_rope = window is not None and config.local_rope is not None
        self.how = LayerAttention(
            scale=None if config.query_pre_attn_scalar is None else config.attention_scale,
            sliding_window=window, softcap=config.attn_logit_softcapping)

    def forward(self, x: torch.Tensor, rope: Rope, attn: AttentionBackend) -> torch.Tensor:
        heads = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)
        q_heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        cos, sin = rope[self.local_rope]
        if self.cpu_kernels and self.q_norm is None and self.rotary.dim == self.head_dim:
            layer_kernels.rotate_(heads, q_heads + kv_heads, cos, sin)
            q, k, v = heads.split((q_heads, kv_heads, kv_heads), dim=1)
        else:
            q, k, v = heads.split((q_heads, kv_heads, kv_heads), dim=1)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)
        out = attn.forward(self.layer_id, q, k, v, self.how)
        return cast(torch.Tensor, self.o_proj(out.flatten(1)))

    def declared(self) -> Attention:
        qkv = self.qkv_proj
        return Attention(
            heads=qkv.num_heads, kv_heads=qkv.num_kv_heads, head_dim=self.head_dim,
            rotary_dim=self.rotary.dim,
            scale=self.head_dim ** -0.5 if self.how.scale is None else self.how.scale,
            q_norm=None if self.q_norm is None else self.q_norm.declared(),
            k_norm=None if self.k_norm is None else self.k_norm.declared(),
            sliding_window=self.how.sliding_window, logit_softcap=self.how.softcap)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: ParallelGroup) -> None:
        super().__init__()
        self.act = _ACTIVATIONS[config.hidden_act]
        self.activation = _DECLARED_ACTIVATIONS[config.hidden_act]
        self.gate_up_proj = GateUpParallelLinear(config.hidden_size, config.intermediate_size, tp)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return cast(torch.Tensor, self.down_proj(self.act(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, family: Family, layer: int, local: int,
                 tp: ParallelGroup, rotary: Rotary) -> None:
        super().__init__()
        norm = GemmaRMSNorm if family.gemma else RMSNorm
        self.gemma = family.gemma
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, family, layer, local, tp, rotary)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        if family.gemma:
            self.pre_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.mlp: MLP | SparseMoe = MLP(config, tp)
        if config.moe is not None and config.moe.sparse_layers[layer]:
            self.mlp = SparseMoe(config.hidden_size, config.moe,
                                 _ACTIVATIONS[config.hidden_act], tp)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, rope, attn)
        if not self.gemma:
            hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
            return self.mlp(hidden), residual
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual

    def declared(self) -> DecodeLayer:
        """This layer as the kernels read it (`shoal.kernels.interface.DecodeLayer`)."""
        attn, qkv = self.self_attn, self.self_attn.qkv_proj
        other = []
        if self.gemma:
            other.append("norms after attention and after the MLP")
        if attn.local_rope:
            other.append("a rotary embedding of its own")
        mlp = None
        if isinstance(self.mlp, MLP):
            mlp = GatedMLP(self.mlp.gate_up_proj, self.mlp.down_proj, self.mlp.activation)
        pre_mlp_norm = self.pre_feedforward_layernorm if self.gemma else (
            self.post_attention_layernorm)
        return DecodeLayer(
            input_norm=self.input_layernorm.declared(), qkv=qkv, qkv_bias=qkv.bias,
            o=attn.o_proj, o_bias=attn.o_proj.bias, post_attention_norm=pre_mlp_norm.declared(),
            attention=attn.declared(), mlp=mlp, other=tuple(other))


class DecoderForCausalLM(nn.Module):
    """The last stage returns logits at `batch.logits_at` (soft-capped where the config says);
    the others (hidden, residual) for the next stage. A `shoal.kernels.interface.KernelModel`:
    `fused_decode` and `greedy_head` are set by `shoal.kernels.prepare` from what `kernel_spec`
    declares."""

    fused_decode: DecodeRunner | None = None
    greedy_head: GreedyLogits | None = None

    def __init__(self, config: ModelConfig, tp: ParallelGroup, start_layer: int,
                 end_layer: int) -> None:
        super().__init__()
        if not 0 <= start_layer < end_layer <= config.num_layers:
            raise ValueError(f"bad layer range [{start_layer}, {end_layer}) "
                             f"for {config.num_layers} layers")
        self.config = config
        self.family = family = FAMILIES[config.architecture]
        self.start_layer, self.end_layer = start_layer, end_layer
        self.is_first = start_layer == 0
        self.is_last = end_layer == config.num_layers
        self.rotary = Rotary(config.head_dim, config.rope)
        self.local_rotary = (self.rotary if config.local_rope is None
                             else Rotary(config.head_dim, config.local_rope))
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.is_first:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        # Local layer i is global layer start_layer + i; its KV lives in KV pool layer i.
        self.layers = nn.ModuleList(
            DecoderLayer(config, family, start_layer + i, i, tp,
                         self._rotary_of(start_layer + i))
            for i in range(end_layer - start_layer))
        self.norm: RMSNorm | None = None
        self.lm_head: ParallelLMHead | None = None
        if self.is_last:
            self.norm = (GemmaRMSNorm if family.gemma else RMSNorm)(config.hidden_size,
                                                                    config.rms_norm_eps)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
            if config.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight

    def _rotary_of(self, layer: int) -> Rotary:
        windowed = bool(self.config.layer_windows) and self.config.layer_windows[layer] is not None
        return self.local_rotary if windowed else self.rotary

    def forward(self, batch: ForwardBatch, attn: AttentionBackend,
                hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits at `batch.logits_at` on the last stage, else the (hidden, residual)
        [num_tokens, hidden_size] the next stage continues from."""
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(batch.input_ids)
            if self.family.gemma:
                hidden = hidden * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype)
        assert hidden is not None, "a stage after the first needs the previous stage's hidden"
        rope = {False: self.rotary.cos_sin(batch.positions, hidden.dtype)}
        rope[True] = (rope[False] if self.local_rotary is self.rotary
                      else self.local_rotary.cos_sin(batch.positions, hidden.dtype))
        paged = attn.paged_decode() if self.fused_decode is not None else None
        if paged is not None:
            assert self.fused_decode is not None
            hidden, residual = self.fused_decode.forward(hidden, residual, *rope[False], paged)
        else:
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, rope, attn)
        assert residual is not None
        if self.norm is None or self.lm_head is None:
            return hidden, residual
        at = batch.logits_at
        hidden, _ = self.norm.add_and_norm(hidden[at], residual[at])
        if self.greedy_head is not None and batch.argmax_only and hidden.shape[0] <= MAX_ROWS:
            logits = self.greedy_head.logits(hidden)
        else:
            logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def kernel_spec(self) -> ModelKernels:
        """What the kernels may take: the linear layers, the norms and attention layers' small
        steps (not the per-head q/k norms), the layers as declared. A greedy step's LM head may
        be screened: the final soft-cap is monotonic, so it keeps the argmax."""
        return ModelKernels(
            linears=[m for m in self.modules() if isinstance(m, Linear)],
            layer_ops=[m for m in self.modules()
                       if isinstance(m, RMSNorm | SelfAttention)
                       and not isinstance(m, HeadRMSNorm)],
            decode_layers=[cast(DecoderLayer, layer).declared() for layer in self.layers],
            lm_head=self.lm_head, vocab_size=self.config.vocab_size)

    def load_weight(self, name: str, source: TensorSlice) -> list[str]:
        """Copy checkpoint tensor `name` into the parameters this stage and rank own."""
        filled = []
        for target in self._targets(name):
            filled += self._load(target, source)
        return filled

    def _load(self, target: str, source: TensorSlice) -> list[str]:
        module, param = target.rsplit(".", 1)
        parent, _, projection = module.rpartition(".")
        block = self.family.moe_block
        if f".{block}." in target and isinstance(
                layer_mlp := self.get_submodule(target.split(f".{block}.")[0] + ".mlp"),
                SparseMoe):
            layer_prefix, rest = target.split(f".{block}.", 1)
            names = dict(zip(self.family.expert_names, ("gate_proj", "up_proj", "down_proj")))
            rest = ".".join(names.get(part, part) for part in rest.split("."))
            return [f"{layer_prefix}.mlp.{p}" for p in layer_mlp.load_weight(rest, source)]
        if self.family.fused_checkpoint and projection in ("qkv_proj", "gate_up_proj"):
            return self._load_fused(module, param, projection, source)
        shard = None
        if projection in _FUSED:
            projection, shard = _FUSED[projection]
            module = f"{parent}.{projection}"
        cast(_WeightOwner, self.get_submodule(module)).load_weight(param, source, shard)
        return [f"{module}.{param}"]

    def _load_fused(self, module: str, param: str, projection: str, source: TensorSlice
                    ) -> list[str]:
        """A checkpoint's fused q/k/v (rows q, k, v) or gate/up (rows gate, up), part by part."""
        config = self.config
        if projection == "qkv_proj":
            q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
            parts: tuple[tuple[str, int], ...] = (("q", 0), ("k", q), ("v", q + kv))
        else:
            parts = (("gate", 0), ("up", config.intermediate_size))
        owner = cast(_WeightOwner, self.get_submodule(module))
        for shard, offset in parts:
            owner.load_weight(param, _RowsFrom(source, offset), shard)
        return [f"{module}.{param}"]

    def _targets(self, name: str) -> list[str]:
        """Our parameter names (before fusing) that checkpoint tensor `name` fills here."""
        tied = self.config.tie_word_embeddings
        if name == "model.embed_tokens.weight":
            return ([name.removeprefix("model.")] if self.is_first else []) + (
                ["lm_head.weight"] if tied and self.is_last and not self.is_first else [])
        if name == "lm_head.weight":
            return [name] if self.is_last and not tied else []
        if name == "model.norm.weight":
            return ["norm.weight"] if self.is_last else []
        if not name.startswith("model.layers.") or "rotary_emb" in name:
            return []
        index, rest = name.removeprefix("model.layers.").split(".", 1)
        if not self.start_layer <= int(index) < self.end_layer:
            return []
        return [f"layers.{int(index) - self.start_layer}.{rest}"]
