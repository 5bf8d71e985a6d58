"""Model path resolution and tokenizer loading, shared by every component."""

from __future__ import annotations

import json
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
