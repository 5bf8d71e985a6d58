"""Acceptance (issue 15): with an API key, every route of the app but `/health*` refuses a
missing or wrong key with 401 and serves the right one; the key never shows in the logs,
`/server_info` or `ps`.

The routes are enumerated from the app itself (tests/support/routes.py), so a route added later
is covered without touching this test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from transformers import PreTrainedTokenizerBase

from shoal.config import ServerArgs
from tests.support.routes import app_routes, request_targets
from tests.support.server import RunningServer, start_server

API_KEY = "sk-issue15-" + "7f3a9c" * 4
WRONG_KEYS = {"missing": None, "wrong": "sk-wrong", "empty": "", "other-scheme": API_KEY}


def headers_for(key_case: str) -> dict[str, str]:
    key = WRONG_KEYS[key_case]
    if key is None:
        return {}
    scheme = "Basic" if key_case == "other-scheme" else "Bearer"
    return {"Authorization": f"{scheme} {key}".strip()}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(Path(tmp_path_factory.mktemp("auth")), "--max-total-tokens", "4096",
                          "--enable-metrics", env={"SHOAL_API_KEY": API_KEY})
    yield server
    server.stop()


def test_every_route_but_health_needs_the_key(server: RunningServer,
                                              tokenizer: PreTrainedTokenizerBase) -> None:
    routes = request_targets(app_routes(ServerArgs(api_key=API_KEY, enable_metrics=True),
                                        tokenizer), "SmolLM2-135M-Instruct")
    assert {path for _, path in routes} >= {
        "/v1/chat/completions", "/v1/completions", "/v1/models", "/generate", "/abort_request",
        "/server_info", "/flush_cache", "/metrics", "/health", "/health_generate",
        "/openapi.json", "/docs"}
    right = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        for method, path in routes:
            body = {} if method == "POST" else None
            for case in WRONG_KEYS:
                r = client.request(method, path, json=body, headers=headers_for(case))
                if path.startswith("/health"):
                    assert r.status_code == 200, (method, path, case, r.text)
                else:
                    assert r.status_code == 401, (method, path, case, r.text)
                    assert r.json()["error"]["type"] == "authentication_error"
            r = client.request(method, path, json=body, headers=right)
            assert r.status_code not in (401, 403) and r.status_code < 500, \
                (method, path, r.status_code, r.text)


def test_the_key_shows_nowhere(server: RunningServer) -> None:
    right = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, timeout=120, headers=right) as client:
        info = client.get("/server_info")
        assert info.status_code == 200
        assert API_KEY not in info.text and info.json()["api_key"] == "<redacted>"
        generated = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert generated.status_code == 200
        assert client.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"}
                          ).status_code == 401
    assert API_KEY not in server.log()
    for process in psutil.process_iter(["cmdline"]):
        assert API_KEY not in " ".join(process.info["cmdline"] or []), process
