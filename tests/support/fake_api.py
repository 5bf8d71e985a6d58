"""The real api app (uvicorn + TokenizerManager) in a thread, over a `FakeEngine`: the api
process end to end over HTTP, in milliseconds per request."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from shoal.api.http_server import create_app
from shoal.api.tokenizer_manager import TokenizerManager
from shoal.config import ComponentArgs, ServerArgs
from tests.support.fake_engine import FakeEngine, ServerThread
from tests.support.wait import wait_until

MODEL = "smol-test"
CONTEXT = 4096


@dataclass
class FakeAPI:
    server: ServerThread
    engine: FakeEngine
    tm: TokenizerManager

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()
        self.engine.stop()


def start_fake_api(tokenizer: PreTrainedTokenizerBase, api_key: str | None = None,
                   send_ready: bool = True, context_length: int | None = None) -> FakeAPI:
    """`context_length`: the api's `--context-length` (the engine reports `CONTEXT` when ready)."""
    run_dir = tempfile.mkdtemp(prefix="shoal-api-")
    args = ServerArgs(served_model_name=MODEL, api_key=api_key, context_length=context_length)
    tm = TokenizerManager(args, ComponentArgs(run_dir=run_dir), tokenizer, disconnect_poll_s=0.05)
    engine = FakeEngine(run_dir, context_length=CONTEXT, send_ready=send_ready).start()
    server = ServerThread(create_app(args, tm)).start()
    if send_ready:
        wait_until(lambda: tm.is_ready, timeout=5, what="the api sees the components ready",
                   interval=0.01)
    return FakeAPI(server, engine, tm)


@contextmanager
def fake_api(tokenizer: PreTrainedTokenizerBase) -> Iterator[FakeAPI]:
    api = start_fake_api(tokenizer)
    try:
        yield api
    finally:
        api.stop()
