"""Acceptance (embeddings): all-MiniLM-L6-v2 served through the scheduler matches transformers'
BertModel with the same pooling, batched or not; the official client works; bad input is a 4xx
with the OpenAI error body and the server stays healthy; each kind of model refuses the other's
requests."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from openai import OpenAI
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerBase

from shoal import model_store
from shoal.api.embeddings_protocol import EmbeddingRequest
from tests.support.metrics import scrape
from tests.support.server import RunningServer, start_server

MODEL = "all-MiniLM-L6-v2"
MAX_TOKENS = 512
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Le renard brun rapide saute par-dessus le chien paresseux.",
    "El rápido zorro marrón salta sobre el perro perezoso.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "敏捷的棕色狐狸跳过了懒狗。",
    "素早い茶色の狐がのろまな犬を飛び越える。",
    "الثعلب البني السريع يقفز فوق الكلب الكسول.",
    "तेज़ भूरी लोमड़ी आलसी कुत्ते के ऊपर कूदती है।",
    "Shipping container logistics 🚢 and ports at 3 a.m. — costs up 12.5%!",
]


def _texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """64 texts in several languages, from one word to the model's whole 512 tokens."""
    texts = ["fox", "?"]
    for i in range(62):
        words = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(80))
        ids = tokenizer(words, add_special_tokens=False)["input_ids"]
        keep = 2 + i * (MAX_TOKENS - 4) // 61  # content tokens, [CLS] and [SEP] aside
        while len(tokenizer(text := tokenizer.decode(ids[:keep]))["input_ids"]) > MAX_TOKENS:
            keep -= 1
        texts.append(text)
    return texts


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(Path(tmp_path_factory.mktemp("embedding-server")),
                          "--model-path", MODEL, "--enable-metrics")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference() -> tuple[PreTrainedTokenizerBase, Any]:
    path = model_store.prepare(MODEL)
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


def _reference_vectors(model: Any, batch: list[list[int]]) -> torch.Tensor:
    """transformers' BertModel on each input alone, mean pooling and L2 normalisation (the
    model's sentence-transformers modules)."""
    vectors = []
    with torch.no_grad():
        for ids in batch:
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            vectors.append(F.normalize(hidden.mean(dim=0), dim=0))
    return torch.stack(vectors)


def _embed(server: RunningServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.openai_url + "/embeddings", json={"model": MODEL, **body},
                      timeout=300)


def _vectors(response: httpx.Response) -> torch.Tensor:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return torch.tensor([d["embedding"] for d in data])


def test_64_texts_match_transformers_batched_and_alone(
        embedding_server: RunningServer, reference: tuple[PreTrainedTokenizerBase, Any]) -> None:
    tokenizer, model = reference
    texts = _texts(tokenizer)
    token_ids = [tokenizer(text)["input_ids"] for text in texts]
    lengths = [len(ids) for ids in token_ids]
    assert min(lengths) == 3 and max(lengths) == MAX_TOKENS and len(set(lengths)) > 50
    expected = _reference_vectors(model, token_ids)

    batched = _embed(embedding_server, {"input": texts})
    assert batched.json()["usage"] == {"prompt_tokens": sum(lengths),
                                       "total_tokens": sum(lengths)}
    similarity = F.cosine_similarity(_vectors(batched), expected)
    assert similarity.min().item() >= 0.99999, similarity.tolist()

    alone = torch.cat([_vectors(_embed(embedding_server, {"input": text})) for text in texts])
    torch.testing.assert_close(alone, _vectors(batched), rtol=0, atol=1e-5)

    # token ids as input, from one token to the model's 512
    edge = [[101], token_ids[-1]]
    torch.testing.assert_close(_vectors(_embed(embedding_server, {"input": edge})),
                               _reference_vectors(model, edge), rtol=0, atol=1e-5)


def test_the_official_client_in_float_and_base64(embedding_server: RunningServer) -> None:
    client = OpenAI(base_url=embedding_server.openai_url, api_key="unused", max_retries=0)
    texts = ["A sentence to embed.", "Eine zweite."]
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [len(d.embedding) for d in floats.data] == [384, 384]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    assert floats.model == MODEL
    # the client asks for base64 by default and decodes it itself (equal up to float rounding:
    # the inputs may share a forward with different padding)
    decoded = client.embeddings.create(model=MODEL, input=texts)
    np.testing.assert_allclose([d.embedding for d in decoded.data],
                               [d.embedding for d in floats.data], rtol=0, atol=1e-6)
    raw = _embed(embedding_server, {"input": texts[0], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, np.float32(floats.data[0].embedding), rtol=0, atol=1e-6)
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": []}, "input", "empty"),
    ({"input": ["a"] * 10_000}, "input", "at most 2048"),
    ({"input": [1, "a"]}, "input", ""),
    ({"input": [{"text": "a"}]}, "input", ""),
    ({"input": ["fine", ""]}, "input", "empty string"),
    ({"input": "word " * 600}, "input", "at most 512"),
    ({"input": [[101, 99999]]}, "input", "out of the vocabulary"),
    ({"input": [[]]}, "input", "empty"),
    ({"input": "a", "dimensions": 128}, "dimensions", "384 dimensions"),
    ({"input": "a", "truncate_prompt_tokens": 600}, "truncate_prompt_tokens", "512"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": "a", "temperature": 0.5}, "temperature", ""),
])
def test_bad_input_is_a_400_with_the_openai_body(embedding_server: RunningServer,
                                                  body: dict[str, Any], param: str,
                                                  words: str) -> None:
    response = _embed(embedding_server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert words in error["message"]
    assert httpx.get(embedding_server.base_url + "/health_generate", timeout=60).status_code \
        == 200


def test_every_request_field_is_honoured_or_ignored_and_documented(
        embedding_server: RunningServer) -> None:
    """`input`, `encoding_format`, `dimensions` and `truncate_prompt_tokens` have their effects
    checked in the tests above; here `model` and the ignored `user`."""
    honoured = {"input", "model", "encoding_format", "dimensions", "truncate_prompt_tokens"}
    assert set(EmbeddingRequest.model_fields) == honoured | EmbeddingRequest.ignored_fields
    docs = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    section = docs[docs.index("## `/v1/embeddings`"):]
    assert all(f"`{name}`" in section for name in EmbeddingRequest.model_fields)
    assert _embed(embedding_server, {"input": "x", "model": "other"}).status_code == 404
    torch.testing.assert_close(_vectors(_embed(embedding_server, {"input": "x", "user": "u"})),
                               _vectors(_embed(embedding_server, {"input": "x"})),
                               rtol=0, atol=1e-6)


def test_truncation_when_asked_keeps_the_first_tokens(
        embedding_server: RunningServer, reference: tuple[PreTrainedTokenizerBase, Any]) -> None:
    tokenizer, model = reference
    text = "word " * 600
    cut = _vectors(_embed(embedding_server, {"input": text, "truncate_prompt_tokens": 512}))
    ids = tokenizer(text, truncation=True, max_length=512)["input_ids"]
    assert len(ids) == 512
    torch.testing.assert_close(cut, _reference_vectors(model, [ids]), rtol=0, atol=1e-5)


def test_an_embedding_model_refuses_generation(embedding_server: RunningServer) -> None:
    for path, body in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"prompt": "hi"}),
            ("/generate", {"text": "hi"})]:
        response = httpx.post(embedding_server.base_url + path, json=body, timeout=60)
        assert response.status_code == 400, (path, response.text)
        assert "embedding model" in response.json()["error"]["message"]


def test_a_generation_model_refuses_embeddings(default_server: RunningServer) -> None:
    response = httpx.post(default_server.openai_url + "/embeddings", json={"input": "hi"},
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "generation model" in error["message"] and error["param"] == "model"


def test_metrics_info_and_process_titles(embedding_server: RunningServer) -> None:
    before = scrape(embedding_server.base_url)
    assert _embed(embedding_server, {"input": ["one two", "three"]}).status_code == 200
    after = scrape(embedding_server.base_url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("shoal:embedding_requests_total") == 1
    assert delta("shoal:embedding_inputs_total") == 2
    assert delta("shoal:embedding_tokens_total") == 4 + 3  # [CLS] ... [SEP]
    info = httpx.get(embedding_server.base_url + "/server_info", timeout=30).json()
    assert info["scheduler"]["num_waiting_reqs"] == 0
    assert info["scheduler"]["num_embedded_inputs"] >= 2
    assert info["limits"]["context_length"] == MAX_TOKENS
    assert set(embedding_server.component_pids()) == {
        "shoal::api", "shoal::detokenizer", "shoal::scheduler_TP0"}
