"""Shared fixtures: one real default-model server for the integration tests of a session, the
default model, its tokenizer, and an OpenAI client of that server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI
from transformers import PreTrainedTokenizerBase

from tests.support.server import RunningServer, start_server


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(Path(tmp_path_factory.mktemp("default-server")),
                          "--max-total-tokens", "65536", "--enable-metrics")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def model_path() -> str:
    from shoal import model_store

    return str(model_store.prepare())


@pytest.fixture(scope="session")
def tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    from shoal.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def openai_client(default_server: RunningServer) -> OpenAI:
    return OpenAI(base_url=default_server.openai_url, api_key="unused", max_retries=0)
