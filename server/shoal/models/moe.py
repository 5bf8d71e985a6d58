"""A mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral), tensor-parallel.

Every rank holds every expert's share of the intermediate dimension (as a dense MLP is split)
and the whole router, so all ranks route each token alike; each sums its partial outputs of the
routed experts and of the shared expert, and one all-reduce adds the ranks' sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shoal.model_config import MoeConfig
from shoal.models.loader import TensorSlice, read_cols, read_rows
from shoal.models.parallel import ParallelGroup

# the checkpoint's expert projection -> (our parameter, its part)
_EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class SparseMoe(nn.Module):
    """Checkpoint names under the block, as `load_weight` takes them: `gate.weight` (the
    router), `experts.{e}.{gate_proj,up_proj,down_proj}.weight`, and where there is a shared
    expert `shared_expert.{gate_proj,up_proj,down_proj}.weight` and `shared_expert_gate.weight`."""

    def __init__(self, hidden_size: int, moe: MoeConfig,
                 act: Callable[[torch.Tensor], torch.Tensor], tp: ParallelGroup) -> None:
        super().__init__()
        self.moe, self.act, self.tp = moe, act, tp
        self.start, self.size = tp.shard(moe.intermediate_size)
        self.router = _parameter(moe.num_experts, hidden_size)
        self.experts_gate_up = _parameter(moe.num_experts, 2 * self.size, hidden_size)
        self.experts_down = _parameter(moe.num_experts, hidden_size, self.size)
        self.shared_gate_up: nn.Parameter | None = None
        self.shared_down: nn.Parameter | None = None
        self.shared_gate: nn.Parameter | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_start, self.shared_size = tp.shard(moe.shared_expert_intermediate_size)
            self.shared_gate_up = _parameter(2 * self.shared_size, hidden_size)
            self.shared_down = _parameter(hidden_size, self.shared_size)
            self.shared_gate = _parameter(1, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.linear(x, self.router).softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for expert in torch.unique(experts).tolist():
            tokens, choice = (experts == expert).nonzero(as_tuple=True)
            hidden = self._mlp(x[tokens], self.experts_gate_up[expert], self.experts_down[expert])
            out.index_add_(0, tokens, hidden * weights[tokens, choice, None])
        if self.shared_gate_up is not None:
            assert self.shared_down is not None and self.shared_gate is not None
            shared = self._mlp(x, self.shared_gate_up, self.shared_down)
            out += torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return self.tp.all_reduce(out)

    def _mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, down)

    def load_weight(self, name: str, source: TensorSlice) -> list[str]:
        """Copy checkpoint tensor `name` (relative to the block) into this rank's share; the
        parameters it filled."""
        parts = name.split(".")
        if name == "gate.weight":
            self.router.copy_(source[:])
            return ["router"]
        if name == "shared_expert_gate.weight" and self.shared_gate is not None:
            self.shared_gate.copy_(source[:])
            return ["shared_gate"]
        if parts[0] == "experts" and len(parts) == 4 and parts[2] in _EXPERT_PARTS:
            expert = int(parts[1])
            self._load_mlp(_EXPERT_PARTS[parts[2]], source, self.experts_gate_up[expert],
                           self.experts_down[expert], self.start, self.size)
            return ["experts_down" if parts[2] == "down_proj" else "experts_gate_up"]
        if (parts[0] == "shared_expert" and len(parts) == 3 and parts[1] in _EXPERT_PARTS
                and self.shared_gate_up is not None and self.shared_down is not None):
            self._load_mlp(_EXPERT_PARTS[parts[1]], source, self.shared_gate_up,
                           self.shared_down, self.shared_start, self.shared_size)
            return ["shared_down" if parts[1] == "down_proj" else "shared_gate_up"]
        raise ValueError(f"unexpected mixture-of-experts weight {name!r}")

    @staticmethod
    def _load_mlp(part: str, source: TensorSlice, gate_up: torch.Tensor, down: torch.Tensor,
                  start: int, size: int) -> None:
        if part == "down":
            down.copy_(read_cols(source, start, size))
        else:
            offset = 0 if part == "gate" else size
            gate_up[offset:offset + size].copy_(read_rows(source, start, size))
