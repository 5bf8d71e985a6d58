"""An embedding model's forward: a batch of token id lists in, one vector per list out.

There is no KV pool: an encoder reads each input once. Sequences of a batch are padded to the
longest one; the scheduler batches inputs of similar length to keep the padding small. Forwards
run on the rank's base thread count, which leaves a core free (`shoal.scheduler.process`): the
api works on every embedding request (tokenizing, encoding the vectors) and a second OpenMP
thread beside it stalled the forwards (measured: docs/perf-log.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shoal.model_config import BertConfig
from shoal.models.bert import BertEncoder, Pooling
from shoal.models.loader import load_checkpoint


class EmbeddingRunner:
    def __init__(self, model_path: str | Path, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.config = BertConfig.from_pretrained(model_path)
        self.pooling = Pooling.from_pretrained(model_path)
        with torch.device(device):
            self.model = BertEncoder(self.config, self.pooling).to(dtype)
        load_checkpoint(self.model, model_path)
        self.model.eval()

    @property
    def max_input_tokens(self) -> int:
        return self.config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size

    def embed(self, batch: list[list[int]]) -> np.ndarray:
        """One float32 vector per input, in order ([inputs, dimensions]); every input holds 1 to
        `max_input_tokens` ids."""
        longest = max(len(ids) for ids in batch)
        input_ids = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        lengths = torch.tensor([len(ids) for ids in batch], dtype=torch.long)
        vectors = self.model(input_ids.to(self.device), lengths.to(self.device))
        return vectors.cpu().numpy()
