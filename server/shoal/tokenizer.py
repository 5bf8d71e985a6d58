"""Model path resolution, tokenizer loading and the checkpoint's sampling defaults, shared by
every component."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from shoal import model_store
from shoal.config import ServerArgs
from shoal.lifecycle import StartupFailed


def resolve_model_path(args: ServerArgs) -> str:
    """`--model-path`: a folder, or the name of an embedded model (prepared on first use); none
    given: the embedded default model. `StartupFailed` when an embedded model's wheel is not
    installed."""
    name = model_store.embedded_name(args.model_path)
    if name is None:
        assert args.model_path is not None
        return args.model_path
    try:
        return str(model_store.prepare(name))
    except model_store.ModelNotAvailable as exc:
        raise StartupFailed(str(exc)) from exc


def served_model_name(args: ServerArgs) -> str:
    if args.served_model_name:
        return args.served_model_name
    return model_store.embedded_name(args.model_path) or str(args.model_path).rstrip("/")


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling a request gets for each of these fields it leaves out: OpenAI's defaults,
    or the checkpoint's `generation_config.json` where it sets them (as vLLM and SGLang do)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0


OPENAI_DEFAULTS = SamplingDefaults()


def sampling_defaults(model_path: str) -> SamplingDefaults:
    """The defaults `model_path`'s generation_config.json sets (temperature, top_p, top_k,
    min_p); `StartupFailed` naming the field for a value no request could carry."""
    file = Path(model_path) / "generation_config.json"
    config = json.loads(file.read_text()) if file.exists() else {}
    defaults = SamplingDefaults(
        temperature=float(config.get("temperature", 1.0)), top_p=float(config.get("top_p", 1.0)),
        top_k=int(config.get("top_k") or -1), min_p=float(config.get("min_p") or 0.0))
    invalid = [(defaults.temperature < 0, "temperature"), (not 0 < defaults.top_p <= 1, "top_p"),
               (defaults.top_k < -1, "top_k"), (not 0 <= defaults.min_p <= 1, "min_p")]
    for bad, field in invalid:
        if bad:
            raise StartupFailed(f"{file}: {field}={config[field]!r} is out of range")
    return defaults


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_path)


def load_tokenizer_or_fail(model_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a component that cannot work without it: `StartupFailed` (exit 88) when
    it cannot load."""
    try:
        return load_tokenizer(model_path)
    except (OSError, ValueError) as exc:
        raise StartupFailed(f"cannot load the tokenizer of {model_path}: {exc}") from exc


_COMPOSING = {"NFC", "NFKC"}  # may shorten a text: a base and a mark (or 3 jamo) become one


def max_chars_per_token(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """An upper bound on how many characters of input one token stands for, or None where none
    holds. A BPE token covers at most its vocabulary entry's length (byte-level: a character
    per byte), and a composing normalizer shortens a text at most 3x; WordPiece's [UNK] and a
    fused BPE unknown cover a whole word, so they have no bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    config = json.loads(backend.to_str())
    model = config["model"]
    if model["type"] != "BPE" or (model.get("fuse_unk") and not model.get("byte_fallback")):
        return None
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    return longest * (3 if _composes(config.get("normalizer")) else 1)


def _composes(normalizer: dict[str, Any] | None) -> bool:
    if normalizer is None:
        return False
    if normalizer["type"] == "Sequence":
        return any(_composes(n) for n in normalizer["normalizers"])
    return normalizer["type"] in _COMPOSING
