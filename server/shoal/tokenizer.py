"""Model path resolution and tokenizer loading, shared by every component."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from shoal import model_store
from shoal.config import ServerArgs
from shoal.lifecycle import StartupFailed


def resolve_model_path(args: ServerArgs) -> str:
    """`--model-path`, or the embedded default model (prepared on first use; `StartupFailed` when
    it is not installed)."""
    if args.model_path:
        return args.model_path
    try:
        return str(model_store.prepare(model_store.DEFAULT_MODEL))
    except model_store.ModelNotAvailable as exc:
        raise StartupFailed(str(exc)) from exc


def served_model_name(args: ServerArgs) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model_path:
        return args.model_path.rstrip("/")
    return model_store.DEFAULT_MODEL


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_path)


def load_tokenizer_or_fail(model_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a component that cannot work without it: `StartupFailed` (exit 88) when
    it cannot load."""
    try:
        return load_tokenizer(model_path)
    except (OSError, ValueError) as exc:
        raise StartupFailed(f"cannot load the tokenizer of {model_path}: {exc}") from exc
