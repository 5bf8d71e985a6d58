"""A BERT encoder for sentence embeddings (all-MiniLM-L6-v2 and its family): bidirectional
attention over a padded batch, then the pooling and normalisation the model's
sentence-transformers configuration names (`modules.json`, `1_Pooling/config.json`).

Checkpoint names are transformers' `BertModel` names; query, key and value are read into one
fused projection. The pooler head (`pooler.*`) is not used by sentence-transformers and is not
loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shoal.model_config import BertConfig
from shoal.models.loader import TensorSlice

POOLING_MODES = ("mean", "cls", "max")


@dataclass(frozen=True)
class Pooling:
    """How token states become one vector: `mode` over the real (unpadded) tokens, then an L2
    normalisation when the model's pipeline has a Normalize module."""

    mode: str = "mean"
    normalize: bool = False

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> Pooling:
        """The sentence-transformers pipeline in `modules.json`; without one, mean pooling
        without normalisation (what sentence-transformers builds for a plain BERT checkpoint)."""
        path = Path(model_path)
        modules_file = path / "modules.json"
        if not modules_file.is_file():
            return cls()
        modules = json.loads(modules_file.read_text())
        mode, normalize = "mean", False
        for module in modules:
            kind = module["type"].rsplit(".", 1)[-1]
            if kind == "Pooling":
                mode = _pooling_mode(json.loads((path / module["path"] / "config.json")
                                                .read_text()))
            elif kind == "Normalize":
                normalize = True
            elif kind != "Transformer":
                raise ValueError(f"{model_path}: unsupported sentence-transformers module "
                                 f"{module['type']!r}")
        return cls(mode, normalize)


def _pooling_mode(config: dict[str, object]) -> str:
    chosen = [mode for mode in POOLING_MODES if config.get(f"pooling_mode_{mode}_token")
              or config.get(f"pooling_mode_{mode}_tokens")]
    if len(chosen) != 1:
        raise ValueError(f"exactly one of the pooling modes {POOLING_MODES} must be set: "
                         f"{config}")
    return chosen[0]


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attention_out = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(hidden, config.intermediate_size)
        self.out = nn.Linear(config.intermediate_size, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.approximate = "tanh" if config.hidden_act == "gelu_new" else "none"

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """`hidden` [batch, length, hidden]; `key_mask` [batch, 1, 1, length], True where a
        position holds a real token."""
        batch, length, size = hidden.shape
        q, k, v = (self.qkv(hidden).view(batch, length, 3, self.num_heads, self.head_dim)
                   .permute(2, 0, 3, 1, 4))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        context = context.transpose(1, 2).reshape(batch, length, size)
        hidden = self.attention_norm(hidden + self.attention_out(context))
        inner = F.gelu(self.intermediate(hidden), approximate=self.approximate)
        return self.out_norm(hidden + self.out(inner))


class BertEncoder(nn.Module):
    """Token ids of a padded batch → one pooled vector per sequence."""

    def __init__(self, config: BertConfig, pooling: Pooling) -> None:
        super().__init__()
        self.config = config
        self.pooling = pooling
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """`input_ids` [batch, length] (padding after each sequence's `lengths` tokens, any id);
        returns [batch, hidden] float32."""
        length = input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device)
        real = positions[None, :] < lengths[:, None]  # [batch, length]
        hidden = (self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
                  + self.token_type_embeddings.weight[0])
        hidden = self.embedding_norm(hidden)
        key_mask = real[:, None, None, :]
        for layer in self.layers:
            hidden = layer(hidden, key_mask)
        return self._pool(hidden, real)

    def _pool(self, hidden: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        if self.pooling.mode == "cls":
            pooled = hidden[:, 0]
        elif self.pooling.mode == "max":
            pooled = hidden.masked_fill(~real[..., None], float("-inf")).amax(dim=1)
        else:
            weights = real[..., None].to(hidden.dtype)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        pooled = pooled.float()
        return F.normalize(pooled, p=2, dim=1) if self.pooling.normalize else pooled

    def load_weight(self, name: str, source: TensorSlice) -> list[str]:
        """Copy checkpoint tensor `name` (transformers' BertModel naming, with or without a
        `bert.` prefix) into its parameter; the parameter names it filled."""
        name = name.removeprefix("bert.")
        target = _TOP_LEVEL.get(name)
        if target is not None:
            return self._copy(target, source[:])
        if not name.startswith("encoder.layer."):
            return []  # the pooler head and buffers such as embeddings.position_ids
        index, rest = name.removeprefix("encoder.layer.").split(".", 1)
        prefix = f"layers.{index}."
        for part, offset in (("query", 0), ("key", 1), ("value", 2)):
            if rest.startswith(f"attention.self.{part}."):
                kind = rest.rsplit(".", 1)[1]
                param = self.get_parameter(f"{prefix}qkv.{kind}")
                size = self.config.hidden_size
                param.data[offset * size:(offset + 1) * size].copy_(source[:])
                return [f"{prefix}qkv.{kind}"] if offset == 2 else []
        mapped = _LAYER_NAMES.get(rest)
        return [] if mapped is None else self._copy(prefix + mapped, source[:])

    def _copy(self, name: str, tensor: torch.Tensor) -> list[str]:
        param = self.get_parameter(name)
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                             f"model shape {tuple(param.shape)}")
        param.data.copy_(tensor)
        return [name]


_TOP_LEVEL = {
    "embeddings.word_embeddings.weight": "word_embeddings.weight",
    "embeddings.position_embeddings.weight": "position_embeddings.weight",
    "embeddings.token_type_embeddings.weight": "token_type_embeddings.weight",
    "embeddings.LayerNorm.weight": "embedding_norm.weight",
    "embeddings.LayerNorm.bias": "embedding_norm.bias",
}
_LAYER_NAMES = {
    "attention.output.dense.weight": "attention_out.weight",
    "attention.output.dense.bias": "attention_out.bias",
    "attention.output.LayerNorm.weight": "attention_norm.weight",
    "attention.output.LayerNorm.bias": "attention_norm.bias",
    "intermediate.dense.weight": "intermediate.weight",
    "intermediate.dense.bias": "intermediate.bias",
    "output.dense.weight": "out.weight",
    "output.dense.bias": "out.bias",
    "output.LayerNorm.weight": "out_norm.weight",
    "output.LayerNorm.bias": "out_norm.bias",
}
