"""Model path resolution and tokenizer loading, shared by every component."""

from __future__ import annotations

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
