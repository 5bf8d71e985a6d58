"""Pipeline parallelism: one stage's forward, passing hidden states from stage to stage."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shoal.engine.distributed import RankLayout
from shoal.engine.model_runner import ModelRunner
from shoal.models.forward_batch import ForwardBatch
from shoal.models.parallel import peer_lost_on_error


class PipelineStage:
    """One stage of a pipeline: receive hidden states from the previous stage, run this stage's
    layers, pass them on; only the last stage returns logits."""

    def __init__(self, runner: ModelRunner, layout: RankLayout) -> None:
        self.runner = runner
        self.layout = layout

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        hidden = residual = None
        if not self.layout.is_first_stage:
            src = self.layout.stage_peer(self.layout.pp_rank - 1)
            shape = (batch.num_tokens, self.runner.model_config.hidden_size)
            hidden = torch.empty(shape, dtype=self.runner.dtype, device=self.runner.device)
            residual = torch.empty_like(hidden)
            with peer_lost_on_error("receiving hidden states"):
                dist.recv(hidden, src=src)
                dist.recv(residual, src=src)
        out = self.runner.forward(batch, hidden, residual)
        if self.layout.is_last_stage:
            assert isinstance(out, torch.Tensor)
            return out
        assert isinstance(out, tuple)
        dst = self.layout.stage_peer(self.layout.pp_rank + 1)
        with peer_lost_on_error("sending hidden states"):
            dist.send(out[0].contiguous(), dst=dst)
            dist.send(out[1].contiguous(), dst=dst)
        return None
