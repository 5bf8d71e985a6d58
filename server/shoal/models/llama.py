"""The Llama decoder (RMSNorm, rotary GQA attention, SwiGLU MLP), also serving Qwen2.

A pipeline stage builds the layers [start_layer, end_layer) only. The first stage embeds the
input ids; the last applies the final norm and LM head to each request's last new token (or to
the positions `ForwardBatch.logit_indices` names).
Checkpoint names (`model.layers.{i}.self_attn.q_proj.weight`) map to this stage's local layers
and fused projections in `load_weight`.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from shoal.kernels import layer_kernels
from shoal.kernels.greedy_head import MAX_ROWS
from shoal.kernels.interface import (
    Attention,
    DecodeLayer,
    DecodeRunner,
    GatedMLP,
    GreedyLogits,
    ModelKernels,
)
from shoal.kernels.rotary import apply_rotary
from shoal.model_config import ModelConfig
from shoal.models.attention_backend import AttentionBackend
from shoal.models.forward_batch import ForwardBatch
from shoal.models.layers import (
    GateUpParallelLinear,
    Linear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    head_shard,
)
from shoal.models.loader import TensorSlice
from shoal.models.parallel import ParallelGroup

# checkpoint projection -> (our fused projection, shard)
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class _WeightOwner(Protocol):
    def load_weight(self, param: str, source: TensorSlice, shard: str | None) -> None: ...


class LlamaAttention(nn.Module):
    """`cpu_kernels`: the rotary embedding turns q and k in place in the q/k/v product's
    output (`shoal.kernels.layer_kernels`; a `shoal.kernels.interface.LayerOps`)."""

    cpu_kernels = False

    def __init__(self, config: ModelConfig, layer_id: int, tp: ParallelGroup) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = config.head_dim
        heads = head_shard(config.num_heads, config.num_kv_heads, tp)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, heads,
                                          config.qkv_bias)
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, config.o_proj_bias, tp,
            in_shard=(heads.q_start * config.head_dim, heads.num_heads * config.head_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        heads = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)
        q_heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        if self.cpu_kernels:
            layer_kernels.rotate_(heads, q_heads + kv_heads, cos, sin)
            q, k = heads[:, :q_heads], heads[:, q_heads:q_heads + kv_heads]
        else:
            q, k = apply_rotary(heads[:, :q_heads + kv_heads], cos, sin).split(
                (q_heads, kv_heads), dim=1)
        out = attn.forward(self.layer_id, q, k, heads[:, q_heads + kv_heads:])
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: ParallelGroup) -> None:
        super().__init__()
        self.gate_up_proj = GateUpParallelLinear(config.hidden_size, config.intermediate_size, tp)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: ParallelGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, attn)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual

    def declared(self) -> DecodeLayer:
        """This layer as the kernels read it: the pre-norm form with a SwiGLU MLP."""
        attn, qkv = self.self_attn, self.self_attn.qkv_proj
        return DecodeLayer(
            input_norm=self.input_layernorm.declared(), qkv=qkv, qkv_bias=qkv.bias,
            o=attn.o_proj, o_bias=attn.o_proj.bias,
            post_attention_norm=self.post_attention_layernorm.declared(),
            attention=Attention(heads=qkv.num_heads, kv_heads=qkv.num_kv_heads,
                                head_dim=attn.head_dim, rotary_dim=attn.head_dim,
                                scale=attn.head_dim ** -0.5),
            mlp=GatedMLP(self.mlp.gate_up_proj, self.mlp.down_proj, "silu"))


class LlamaForCausalLM(nn.Module):
    """A `shoal.kernels.interface.KernelModel`: `fused_decode` and `greedy_head` are set by
    `shoal.kernels.prepare` from what `kernel_spec` declares."""

    fused_decode: DecodeRunner | None = None
    greedy_head: GreedyLogits | None = None

    def __init__(self, config: ModelConfig, tp: ParallelGroup, start_layer: int,
                 end_layer: int) -> None:
        super().__init__()
        if not 0 <= start_layer < end_layer <= config.num_layers:
            raise ValueError(f"bad layer range [{start_layer}, {end_layer}) "
                             f"for {config.num_layers} layers")
        self.config = config
        self.start_layer, self.end_layer = start_layer, end_layer
        self.is_first = start_layer == 0
        self.is_last = end_layer == config.num_layers
        self.rotary = RotaryEmbedding(config.head_dim, config.rope)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.is_first:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        # Local layer i is global layer start_layer + i; its KV lives in KV pool layer i.
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, tp)
                                    for i in range(end_layer - start_layer))
        self.norm: RMSNorm | None = None
        self.lm_head: ParallelLMHead | None = None
        if self.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
            if config.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight

    def forward(self, batch: ForwardBatch, attn: AttentionBackend,
                hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits at `batch.logits_at` on the last stage ([batch, vocab] by default: each
        request's last new token), else the (hidden, residual) [num_tokens, hidden_size] the next
        stage continues from."""
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(batch.input_ids)
        assert hidden is not None, "a stage after the first needs the previous stage's hidden"
        cos, sin = self.rotary.cos_sin(batch.positions, hidden.dtype)
        paged = attn.paged_decode() if self.fused_decode is not None else None
        if paged is not None:
            assert self.fused_decode is not None
            hidden, residual = self.fused_decode.forward(hidden, residual, cos, sin, paged)
        else:
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, cos, sin, attn)
        assert residual is not None
        if self.norm is None or self.lm_head is None:
            return hidden, residual
        at = batch.logits_at
        hidden, _ = self.norm.add_and_norm(hidden[at], residual[at])
        if self.greedy_head is not None and batch.argmax_only and hidden.shape[0] <= MAX_ROWS:
            return self.greedy_head.logits(hidden)
        return self.lm_head(hidden)

    def kernel_spec(self) -> ModelKernels:
        return ModelKernels(
            linears=[m for m in self.modules() if isinstance(m, Linear)],
            layer_ops=[m for m in self.modules() if isinstance(m, RMSNorm | LlamaAttention)],
            decode_layers=[cast(LlamaDecoderLayer, layer).declared() for layer in self.layers],
            lm_head=self.lm_head, vocab_size=self.config.vocab_size)

    def load_weight(self, name: str, source: TensorSlice) -> list[str]:
        """Copy checkpoint tensor `name` into the parameters this stage and rank own."""
        filled = []
        for target in self._targets(name):
            module, param = target.rsplit(".", 1)
            parent, _, projection = module.rpartition(".")
            shard = None
            if projection in _FUSED:
                projection, shard = _FUSED[projection]
                module = f"{parent}.{projection}"
            cast(_WeightOwner, self.get_submodule(module)).load_weight(param, source, shard)
            filled.append(f"{module}.{param}")
        return filled

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
