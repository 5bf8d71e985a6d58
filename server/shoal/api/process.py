"""Entry point of the api process: load the tokenizer, serve the app with uvicorn."""

from __future__ import annotations

import dataclasses

import uvicorn

from shoal.api.http_server import create_app
from shoal.api.tokenizer_manager import TokenizerManager
from shoal.config import ComponentArgs, ServerArgs
from shoal.lifecycle import StartupFailed, exit_on_sigterm
from shoal.model_config import BertConfig, ModelConfig, is_encoder_model
from shoal.tokenizer import load_tokenizer_or_fail, resolve_model_path, sampling_defaults


def run_api(args: ServerArgs, component: ComponentArgs) -> None:
    """Serve until uvicorn stops (SIGINT/SIGTERM, after finishing in-flight requests);
    `shoal component api` sets the process title, logging and the exit code around it."""
    model_path = resolve_model_path(args)
    tokenizer = load_tokenizer_or_fail(model_path)
    args = with_context_length(args, model_path)
    app = create_app(args, TokenizerManager(args, component, tokenizer,
                                            sampling_defaults=sampling_defaults(model_path)))
    exit_on_sigterm()
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                access_log=args.log_level.lower() == "debug", timeout_keep_alive=5)


def with_context_length(args: ServerArgs, model_path: str) -> ServerArgs:
    """`args` with `--context-length` resolved as the scheduler resolves it (the model's
    `max_position_embeddings` when not given), so /v1/models and the length checks know it
    before the scheduler reports ready."""
    if args.context_length is not None:
        return args
    try:
        config = (BertConfig.from_pretrained(model_path) if is_encoder_model(model_path)
                  else ModelConfig.from_pretrained(model_path))
    except (OSError, ValueError) as exc:
        raise StartupFailed(f"cannot read the model config of {model_path}: {exc}") from exc
    return dataclasses.replace(args, context_length=config.max_position_embeddings)
