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


# An idle detokenizer wakes this often: a SIGTERM the kernel delivers to another thread (the
# tokenizer's own) interrupts no receive, and its Python handler runs only once the main thread
# runs Python again.
_IDLE_WAKE_MS = 500


def run_detokenizer(args: ServerArgs, component: ComponentArgs) -> None:
    """Serve until SIGTERM, whose handler raises SystemExit in the main thread."""
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
            if not receiver.poll(_IDLE_WAKE_MS):
                continue
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
