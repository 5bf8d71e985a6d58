"""Acceptance (issue 15): the server's own OpenAPI document fuzzed with schemathesis (valid and
invalid bodies for every operation), then hostile requests by hand. No 5xx, no crash, every 4xx
with the OpenAI error body, and afterwards nothing leaked: the KV pool wholly free, the open file
descriptors back where they were, `/health_generate` still 200.

The server's context is small (`--context-length 48`), so a generated request never runs long.
CI fuzzes `FUZZ_EXAMPLES` (15) cases per operation and mode; `make soak` runs 50.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from transformers import PreTrainedTokenizerBase

from shoal.bench.soak import fds_by_component, server_processes
from shoal.config import ServerArgs
from tests.support.routes import DOCUMENT_ROUTES, app_routes, body_models
from tests.support.server import RunningServer, start_server
from tests.support.wait import wait_until

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "15"))
CONTEXT = 48
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(Path(tmp_path_factory.mktemp("fuzz")), "--context-length",
                          str(CONTEXT), "--max-total-tokens", "4096", "--enable-metrics")
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def fds_before(server: RunningServer) -> dict[str, int]:
    """Each component's open fds after one request (the first opens what stays open)."""
    r = httpx.post(server.base_url + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    return fds_by_component(server_processes(server.base_url))


def assert_openai_outcome(response: httpx.Response | Any, what: object) -> None:
    """No 5xx; a 4xx carries `{"error": {"message", "type", "param", "code"}}`."""
    assert response.status_code < 500, (what, response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"] and "code" in error and "param" in error, \
            (what, response.text[:500])


def test_every_route_and_body_model_is_in_the_openapi_document(
        server: RunningServer, tokenizer: PreTrainedTokenizerBase) -> None:
    routes = app_routes(ServerArgs(enable_metrics=True), tokenizer)
    document = httpx.get(server.base_url + "/openapi.json", timeout=30).json()
    assert set(document["paths"]) == {route.path.replace(":path}", "}") for route in routes
                                      if route.path not in DOCUMENT_ROUTES}
    in_document = {path: ops["post"]["requestBody"]["content"]["application/json"]["schema"]
                   for path, ops in document["paths"].items()
                   if "requestBody" in ops.get("post", {})}
    assert {path: schema["$ref"].removeprefix("#/components/schemas/")
            for path, schema in in_document.items()} == body_models(routes)
    assert {CHAT, COMPLETIONS, "/generate", "/abort_request"} <= set(in_document)
    # a bad body is a 400 with the OpenAI error body, as the document says (never a 422)
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (method, path)
            if "requestBody" in operation:
                error = operation["responses"]["400"]["content"]["application/json"]["schema"]
                assert error == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path)
    assert document["components"]["schemas"]["ErrorResponse"]["required"] == ["error"]


FUZZ_SETTINGS = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
                         database=None, phases=[Phase.explicit, Phase.generate],
                         suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_get_no_5xx(server: RunningServer, fds_before: dict[str, int],
                                    mode: GenerationMode) -> None:
    """Every operation of the server's OpenAPI document with requests that follow it
    (positive), and every operation that reads a body with bodies that break it (negative)."""
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    if mode is GenerationMode.NEGATIVE:
        operations = [op for op in operations if op.get_request_payload_content_types()]
    assert len(operations) >= (5 if mode is GenerationMode.NEGATIVE else 12)
    for operation in operations:
        @FUZZ_SETTINGS
        @given(operation.as_strategy(generation_mode=mode))
        def call(case: Any) -> None:
            response = case.call(timeout=120)
            assert_openai_outcome(response, (case.method, case.path, case.body))

        call()


NESTED = 100_000
HOSTILE = [
    ("huge-text-body", COMPLETIONS, json.dumps({"prompt": "hello " * 400_000, "max_tokens": 1}),
     400),
    ("huge-token-list", COMPLETIONS, json.dumps({"prompt": [5] * 1_000_000, "max_tokens": 1}),
     400),
    ("huge-chat", CHAT, json.dumps({"messages": HI * 20_000, "max_tokens": 1}), 400),
    ("deep-array", COMPLETIONS, "[" * NESTED + "]" * NESTED, 400),
    ("deep-object", COMPLETIONS, '{"prompt": ' + '{"a": ' * NESTED + "1" + "}" * NESTED + "}",
     400),
    ("invalid-utf8", COMPLETIONS, b'{"prompt": "\xff\xfe\xfd", "max_tokens": 1}', 400),
    # regression: a lone surrogate is valid JSON that no encoder takes; it was a 500
    ("lone-surrogate", COMPLETIONS, '{"prompt": "\\ud800", "max_tokens": 1}', 400),
    ("lone-surrogate-in-chat", CHAT,
     '{"messages": [{"role": "user", "content": "a\\udfff"}], "max_tokens": 1}', 400),
    ("lone-surrogate-in-stop", COMPLETIONS,
     '{"prompt": "hi", "max_tokens": 1, "stop": ["\\ud800"]}', 400),
    ("nul-characters", COMPLETIONS, '{"prompt": "\\u0000\\u0000", "max_tokens": 1}', 200),
    ("n-a-million", COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "n": 10**6}, 400),
    ("max-tokens-2-63", COMPLETIONS, {"prompt": "hi", "max_tokens": 2**63}, 400),
    ("max-new-tokens-2-63", "/generate",
     {"text": "hi", "sampling_params": {"max_new_tokens": 2**63}}, 400),
    ("min-tokens-2-63", COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "min_tokens": 2**63},
     400),
    ("top-k-2-63", COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "top_k": 2**63}, 200),
    ("seed-2-64", COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "seed": 2**64}, 400),
    ("logit-bias-huge-id", COMPLETIONS,
     {"prompt": "hi", "max_tokens": 1, "logit_bias": {str(2**70): 1}}, 400),
    ("logit-bias-not-an-id", COMPLETIONS,
     {"prompt": "hi", "max_tokens": 1, "logit_bias": {"abc": 1}}, 400),
    ("nan-temperature", COMPLETIONS, '{"prompt": "hi", "max_tokens": 1, "temperature": NaN}',
     400),
    ("infinite-penalty", COMPLETIONS,
     '{"prompt": "hi", "max_tokens": 1, "frequency_penalty": Infinity}', 400),
    ("empty-text", COMPLETIONS, {"prompt": "", "max_tokens": 1}, 400),
    ("empty-token-list", COMPLETIONS, {"prompt": [], "max_tokens": 1}, 400),
    ("one-token-context", COMPLETIONS, {"prompt": [5], "max_tokens": 1}, 200),
    ("context-exactly-full", COMPLETIONS, {"prompt": [5] * (CONTEXT - 1), "max_tokens": 1}, 200),
    ("context-one-over", COMPLETIONS, {"prompt": [5] * CONTEXT, "max_tokens": 1}, 400),
    ("empty-chat-content", CHAT, {"messages": [{"role": "user", "content": ""}],
                                  "max_tokens": 1}, 200),
    ("unknown-field", COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "frobnicate": True}, 400),
    ("unknown-nested-field", CHAT,
     {"messages": [{"role": "user", "content": "hi", "mood": "grumpy"}]}, 400),
    ("body-is-null", COMPLETIONS, "null", 400),
    ("body-is-a-string", COMPLETIONS, '"prompt"', 400),
    ("empty-body", COMPLETIONS, "", 400),
    ("empty-rid", "/generate", {"text": "hi", "rid": "", "sampling_params": {}}, 400),
    ("abort-nothing", "/abort_request", {}, 400),
]


@pytest.mark.parametrize("name,path,body,status", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_body(server: RunningServer, fds_before: dict[str, int], name: str, path: str,
                      body: object, status: int) -> None:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        if isinstance(body, dict):
            r = client.post(path, json=body)
        else:
            r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text[:500]
        assert_openai_outcome(r, name)
        # regression: a request refused while being sent stayed in the api's table forever
        assert client.get("/server_info").json()["num_running_requests"] == 0


@pytest.mark.parametrize("path,body", [
    (COMPLETIONS, {"prompt": "hello " * 4_000_000, "max_tokens": 1}),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 4_000_000}], "max_tokens": 1})],
    ids=["completions", "chat"])
def test_a_text_too_long_for_the_context_is_refused_before_it_is_tokenized(
        server: RunningServer, path: str, body: dict[str, object]) -> None:
    """Regression: a 24 MB prompt was tokenized on the api's event loop (46 s, `/health` waited
    as long) before its 400; now its length in characters refuses it."""
    r = httpx.post(server.base_url + path, json=body, timeout=120)
    assert r.status_code == 400, r.text[:500]
    message = r.json()["error"]["message"]
    assert re.match(rf"The input \(2400\d{{4}} characters\) is longer than the model's context "
                    rf"length \({CONTEXT} tokens\) can hold", message), message


WRONG_CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                       "application/json; charset=latin-1", ""]


@pytest.mark.parametrize("content_type", WRONG_CONTENT_TYPES)
def test_wrong_content_type(server: RunningServer, content_type: str) -> None:
    r = httpx.post(server.base_url + COMPLETIONS, content=b'prompt=hi&max_tokens=1',
                   headers={"content-type": content_type}, timeout=60)
    assert r.status_code == 400, r.text
    assert_openai_outcome(r, content_type)


@pytest.mark.parametrize("extreme", [
    {"temperature": 1e-320}, {"temperature": 1e-40, "top_p": 0.5}, {"top_p": 5e-324},
    {"temperature": 1.0, "repetition_penalty": 1e-300}])
def test_extreme_sampling_values_do_not_crash_the_scheduler(server: RunningServer,
                                                            extreme: dict[str, float]) -> None:
    """Regressions: `temperature: 1e-320` made the sampler's probabilities NaN, `top_p: 5e-324`
    (0 in float32) dropped every token; either crashed the scheduler (the server exited 1)."""
    r = httpx.post(server.base_url + COMPLETIONS, timeout=60,
                   json={"prompt": "the the the the", "max_tokens": 4, **extreme})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4 or \
        r.json()["choices"][0]["finish_reason"] == "stop"
    assert server.proc.poll() is None


def test_a_huge_temperature_is_refused_by_openai_routes_and_sampled_natively(
        server: RunningServer) -> None:
    """`temperature: 1e308` is outside OpenAI's 0-2 (a 400 naming it); native /generate takes
    any temperature, and such a one must not crash the scheduler either."""
    r = httpx.post(server.base_url + COMPLETIONS, timeout=60,
                   json={"prompt": "the the the the", "max_tokens": 4, "temperature": 1e308})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    r = httpx.post(server.base_url + "/generate", timeout=60, json={
        "text": "the the the the", "sampling_params": {"max_new_tokens": 4,
                                                       "temperature": 1e308}})
    assert r.status_code == 200, r.text
    assert 1 <= len(r.json()["output_ids"]) <= 4
    assert server.proc.poll() is None


def test_a_stream_opened_and_never_read(server: RunningServer) -> None:
    """A raw socket sends a streaming request and never reads: others are served meanwhile,
    and once it closes nothing of it is left."""
    body = json.dumps({"prompt": "Count: 1, 2, 3,", "max_tokens": CONTEXT - 20, "stream": True,
                       "ignore_eos": True}).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST " + COMPLETIONS.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: _api_requests(server) == 1, 60, "the api took the unread request")
        r = httpx.post(server.base_url + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200, r.text
    wait_until(lambda: _api_requests(server) == 0 and _scheduler(server)["num_running_reqs"] == 0,
               120, "nothing left of the unread request")


def _api_requests(server: RunningServer) -> int:
    return httpx.get(server.base_url + "/server_info", timeout=10).json()["num_running_requests"]


def _scheduler(server: RunningServer) -> dict[str, int]:
    return httpx.get(server.base_url + "/server_info", timeout=10).json()["scheduler"]


def test_nothing_leaked_after_the_fuzzing(server: RunningServer,
                                          fds_before: dict[str, int]) -> None:
    """Runs last in this module: the pool is whole once idle and flushed, the fds are back."""
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        wait_until(lambda: client.get("/server_info").json()["num_running_requests"] == 0, 60,
                   "no request left in the api")
        pool = _scheduler(server)
        assert pool["num_free_slots"] + pool["num_cached_slots"] == pool["num_total_slots"], pool
        assert client.post("/flush_cache").status_code == 200
        pool = _scheduler(server)
        assert pool["num_free_slots"] == pool["num_total_slots"], pool
        assert client.get("/health_generate").status_code == 200
    processes = server_processes(server.base_url)
    wait_until(lambda: all(count <= fds_before[name]
                           for name, count in fds_by_component(processes).items()), 30,
               f"open fds back to {fds_before}")
    assert "KV pool leak" not in server.log()
    assert "Traceback" not in server.log(), server.log()[-5000:]
