"""The detokenizer loop: `BatchTokenOut` from scheduler rank 0 → `BatchStrOut` to the api."""

from __future__ import annotations

import logging

import zmq

from shoal.config import ComponentArgs, ServerArgs
from shoal.detokenizer.incremental import IncrementalDetokenizer
from shoal.ipc.messages import BatchStrOut, BatchTokenOut, ComponentReady, ReqStrOut, ReqTokenOut
from shoal.ipc.sockets import Endpoints, pull_socket, push_socket, recv, send
from shoal.lifecycle import exit_on_sigterm
from shoal.tokenizer import load_tokenizer_or_fail, resolve_model_path

logger = logging.getLogger(__name__)


def run_detokenizer(args: ServerArgs, component: ComponentArgs) -> None:
    """Serve until SIGTERM, which raises SystemExit out of the blocking receive."""
    exit_on_sigterm()
    detokenizer = IncrementalDetokenizer(load_tokenizer_or_fail(resolve_model_path(args)))
    endpoints = Endpoints(component.run_dir)
    ctx = zmq.Context()
    receiver = pull_socket(ctx, endpoints.detokenizer_input)
    sender = push_socket(ctx, endpoints.api_input)
    try:
        send(sender, ComponentReady(component="detokenizer"))
        logger.info("detokenizer ready")
        while True:
            message = recv(receiver)
            if not isinstance(message, BatchTokenOut):
                logger.warning("detokenizer ignores %s", type(message).__name__)
                continue
            texts = detokenizer.detokenize(message.outputs)
            send(sender, BatchStrOut(outputs=[_str_out(out, text)
                                              for out, text in zip(message.outputs, texts)]))
    finally:
        ctx.destroy(linger=0)


def _str_out(out: ReqTokenOut, text: str) -> ReqStrOut:
    return ReqStrOut(rid=out.rid, text=text, new_ids=out.new_ids, finish=out.finish,
                     prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                     cached_tokens=out.cached_tokens, logprobs=out.logprobs,
                     prompt_logprobs=out.prompt_logprobs)
