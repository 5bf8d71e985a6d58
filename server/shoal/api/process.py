"""Entry point of the api process: load the tokenizer, serve the app with uvicorn."""

from __future__ import annotations

import uvicorn

from shoal.api.http_server import create_app
from shoal.api.tokenizer_manager import TokenizerManager
from shoal.config import ComponentArgs, ServerArgs
from shoal.lifecycle import exit_on_sigterm
from shoal.tokenizer import load_tokenizer_or_fail, resolve_model_path


def run_api(args: ServerArgs, component: ComponentArgs) -> None:
    """Serve until uvicorn stops (SIGINT/SIGTERM, after finishing in-flight requests);
    `shoal component api` sets the process title, logging and the exit code around it."""
    tokenizer = load_tokenizer_or_fail(resolve_model_path(args))
    app = create_app(args, TokenizerManager(args, component, tokenizer))
    exit_on_sigterm()
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                access_log=args.log_level.lower() == "debug", timeout_keep_alive=5)
