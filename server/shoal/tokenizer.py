"""Model path resolution and tokenizer loading, shared by every component."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from shoal import model_store
from shoal.config import ServerArgs


def resolve_model_path(args: ServerArgs) -> str:
    """`--model-path`, or the embedded default model (prepared on first use)."""
    if args.model_path:
        return args.model_path
    return str(model_store.prepare(model_store.DEFAULT_MODEL))


def served_model_name(args: ServerArgs) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model_path:
        return args.model_path.rstrip("/")
    return model_store.DEFAULT_MODEL


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_path)
