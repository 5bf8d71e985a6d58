"""Read a safetensors checkpoint one tensor at a time, handing each rank only its shard.

`safe_open(...).get_slice(name)` reads nothing until indexed, so a layer that narrows a slice
(`source[start:end]`) pulls just its rows or columns from disk. A sharded checkpoint is the
files its `model.safetensors.index.json` names (other *.safetensors beside them, such as a
Mistral repository's `consolidated.safetensors`, are not read); without an index, every
*.safetensors in the folder. Tensors in bf16 or fp16 are converted to the model's dtype as
they are copied in.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import nn


class TensorSlice(Protocol):
    """A checkpoint tensor read lazily: indexing reads only the slice asked for."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


class LoadableModel(Protocol):
    def load_weight(self, name: str, source: TensorSlice) -> list[str]:
        """Copy checkpoint tensor `name` into this rank's parameters; the names it filled."""
        ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...


def read_rows(source: TensorSlice, start: int, size: int) -> torch.Tensor:
    return source[start:start + size]


def read_cols(source: TensorSlice, start: int, size: int) -> torch.Tensor:
    return source[:, start:start + size]


INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_path: str | Path) -> list[Path]:
    folder = Path(model_path)
    index = folder / INDEX_FILE
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in names if not (folder / name).exists()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not there: {missing}")
        return [folder / name for name in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    return files


def load_checkpoint(model: LoadableModel, model_path: str | Path) -> None:
    """Fill every parameter of `model` from the checkpoint; raise if any stays unfilled."""
    filled: set[str] = set()
    for file in checkpoint_files(model_path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                filled.update(model.load_weight(name, f.get_slice(name)))
    missing = sorted(name for name, _ in model.named_parameters() if name not in filled)
    if missing:
        raise ValueError(f"checkpoint {model_path} lacks weights for: {', '.join(missing[:8])}")
