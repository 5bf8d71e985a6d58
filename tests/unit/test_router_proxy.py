"""`shoal router` in front of fake workers (small FastAPI apps on free ports): what it sends
where, what the client gets, retries before the first byte, disconnects, health."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from shoal.api.auth import APIKeyMiddleware
from shoal.ports import free_port
from shoal.router import proxy
from shoal.router.app import create_app
from shoal.router.args import RouterArgs, add_router_flags, router_args_from_namespace
from shoal.router.proxy import bootstrap_fields, prompt_text
from shoal.router.workers import service_urls
from tests.support.wait import wait_until


@dataclass
class FakeWorker:
    """Answers /health, /server_info (its mode) and the generation routes: `reply` decides
    ("ok": a JSON body or SSE chunks naming the worker; "400"/"500": an error), `delay_s` slows
    each chunk. Records each body, and how many responses were cut off by the client."""

    mode: str = "null"
    bootstrap_port: int = 8998
    model: str = "fake"
    reply: str = "ok"
    delay_s: float = 0.0
    healthy: bool = True
    api_key: str | None = None  # the engine's own check (shoal.api.auth), as with SHOAL_API_KEY
    bodies: list[dict[str, Any]] = field(default_factory=list)
    cut_off: int = 0
    port: int = field(default_factory=free_port)
    server: uvicorn.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> FastAPI:
        app = FastAPI()
        if self.api_key:
            app.add_middleware(APIKeyMiddleware, api_key=self.api_key)

        @app.get("/health")
        async def health() -> Any:
            return JSONResponse({}, status_code=200 if self.healthy else 503)

        @app.get("/server_info")
        async def info() -> Any:
            return {"disaggregation_mode": self.mode,
                    "disaggregation_bootstrap_port": self.bootstrap_port,
                    "served_model_name": self.model}

        @app.get("/v1/models")
        async def models() -> Any:
            return {"object": "list", "data": [{"id": "fake"}]}

        @app.post("/generate")
        @app.post("/v1/completions")
        @app.post("/v1/responses")
        async def generate(request: Request) -> Any:
            body = await request.json()
            self.bodies.append(body)
            if self.reply != "ok":
                return JSONResponse({"error": {"message": f"{self.mode} says {self.reply}"}},
                                    status_code=int(self.reply))
            if body.get("stream"):
                return StreamingResponse(self._chunks(), media_type="text/event-stream")
            await asyncio.sleep(self.delay_s)
            return {"text": f"from {self.mode}", "worker": self.port}

        return app

    async def _chunks(self) -> AsyncIterator[str]:
        try:
            for i in range(5):
                await asyncio.sleep(self.delay_s)
                yield f"data: {json.dumps({'i': i, 'worker': self.port})}\n\n"
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            self.cut_off += 1
            raise

    def start(self) -> FakeWorker:
        self.server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        threading.Thread(target=self.server.run, daemon=True).start()
        wait_until(lambda: self.server is not None and self.server.started, 10, "fake worker up")
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            wait_until(lambda: self.server is None or not self.server.started
                       or self._closed(), 10, "fake worker down")

    def _closed(self) -> bool:
        try:
            httpx.get(self.url + "/health", timeout=0.5)
        except httpx.TransportError:
            return True
        return False


@dataclass
class Router:
    args: RouterArgs
    server: uvicorn.Server

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.args.port}"

    def post(self, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=20, **kwargs)


@pytest.fixture
def start_router() -> Iterator[Any]:
    running: list[uvicorn.Server] = []

    def start(wait_healthy: bool = True, **kwargs: Any) -> Router:
        args = RouterArgs(port=free_port(), **{"health_check_interval": 0.2, **kwargs})
        server = uvicorn.Server(uvicorn.Config(create_app(args), host="127.0.0.1",
                                               port=args.port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        running.append(server)
        router = Router(args, server)
        wait_until(lambda: server.started and (
            _status(router.url + "/health") == 200 or not wait_healthy), 10,
            "the router is healthy")
        return router

    yield start
    for server in running:
        server.should_exit = True


@pytest.fixture
def workers() -> Iterator[list[FakeWorker]]:
    made: list[FakeWorker] = []
    yield made
    for worker in made:
        worker.stop()


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return 0


def _spawn(made: list[FakeWorker], **kwargs: Any) -> FakeWorker:
    worker = FakeWorker(**kwargs).start()
    made.append(worker)
    return worker


def test_round_robin_over_colocated_workers_passes_bodies_through(
        start_router: Any, workers: list[FakeWorker]) -> None:
    a, b = _spawn(workers), _spawn(workers)
    router = start_router(workers=(a.url, b.url), policy="round_robin")
    answered = [router.post("/generate", {"text": "hi"}).json()["worker"] for _ in range(4)]
    assert sorted(answered) == sorted([a.port, b.port] * 2) and answered[0] != answered[1]
    streamed = router.post("/v1/completions", {"prompt": "hi", "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.count("data: ") == 6 and streamed.text.endswith("data: [DONE]\n\n")
    assert a.bodies[0] == {"text": "hi"}  # untouched: no bootstrap fields for a colocated worker


def test_a_key_from_the_environment_is_checked_and_sent_on_to_the_workers(
        start_router: Any, workers: list[FakeWorker], monkeypatch: pytest.MonkeyPatch) -> None:
    worker = _spawn(workers, api_key="s3cret")
    monkeypatch.setenv("SHOAL_API_KEY", "s3cret")
    parser = argparse.ArgumentParser()
    add_router_flags(parser)
    args = router_args_from_namespace(parser.parse_args(["--worker", worker.url]))
    assert args.api_key == "s3cret"
    # healthy only once it read the worker's /server_info, which needs the key
    router = start_router(workers=args.workers, api_key=args.api_key)
    assert router.post("/generate", {"text": "hi"}).status_code == 401
    wrong = router.post("/generate", {"text": "hi"}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert not worker.bodies  # refused at the router
    ok = router.post("/generate", {"text": "hi"}, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and worker.bodies == [{"text": "hi"}]
    assert httpx.get(router.url + "/health", timeout=5).status_code == 200


def test_a_pair_gets_one_body_with_the_bootstrap_fields_and_the_client_the_decodes_answer(
        start_router: Any, workers: list[FakeWorker]) -> None:
    prefill = _spawn(workers, mode="prefill", bootstrap_port=9123)
    decode = _spawn(workers, mode="decode")
    router = start_router(prefills=(prefill.url,), decodes=(decode.url,))
    response = router.post("/v1/completions", {"prompt": "hello", "max_tokens": 3})
    assert response.status_code == 200 and response.json()["text"] == "from decode"
    wait_until(lambda: prefill.bodies and decode.bodies, 5, "both got the request")
    assert prefill.bodies[0] == decode.bodies[0]
    sent = decode.bodies[0]
    assert (sent["bootstrap_host"], sent["bootstrap_port"]) == ("127.0.0.1", 9123)
    assert 0 <= sent["bootstrap_room"] < 2**63 and sent["prompt"] == "hello"
    router.post("/v1/completions", {"prompt": "again"})
    assert decode.bodies[1]["bootstrap_room"] != sent["bootstrap_room"]


def test_a_response_request_is_paired_like_a_completion(start_router: Any,
                                                        workers: list[FakeWorker]) -> None:
    prefill = _spawn(workers, mode="prefill", bootstrap_port=9124)
    decode = _spawn(workers, mode="decode")
    router = start_router(prefills=(prefill.url,), decodes=(decode.url,))
    body = {"input": [{"role": "user", "content": "hello"}], "max_output_tokens": 3}
    response = router.post("/v1/responses", body)
    assert response.status_code == 200 and response.json()["text"] == "from decode"
    wait_until(lambda: prefill.bodies and decode.bodies, 5, "both got the request")
    sent = decode.bodies[0]
    assert prefill.bodies[0] == sent and 0 <= sent.pop("bootstrap_room") < 2**63
    assert sent == {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": 9124}


@pytest.mark.parametrize("body,text", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "user: hi\n"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
     "user: hi\n"),
    ({"input": "hi"}, "hi"), ({"prompt": "hi"}, "hi"), ({"text": "hi"}, "hi"),
    ({"input_ids": [1, 2]}, "[1, 2]"), ({}, "")])
def test_cache_aware_matches_on_the_prompt_of_every_route(body: dict[str, Any],
                                                         text: str) -> None:
    assert prompt_text(body) == text


def test_a_prefills_400_reaches_the_client_and_closes_the_decodes_request(
        start_router: Any, workers: list[FakeWorker]) -> None:
    prefill = _spawn(workers, mode="prefill", reply="400")
    decode = _spawn(workers, mode="decode", delay_s=1.0)
    router = start_router(prefills=(prefill.url,), decodes=(decode.url,))
    response = router.post("/generate", {"text": "too long", "stream": True})
    assert response.status_code == 400 and "prefill says 400" in response.text
    wait_until(lambda: decode.cut_off == 1, 5, "the decode's stream was closed")


def test_an_unreachable_decode_is_replaced_before_the_first_byte(
        start_router: Any, workers: list[FakeWorker], monkeypatch: pytest.MonkeyPatch) -> None:
    handed_out: list[int] = []

    def recorded(worker: Any) -> dict[str, Any]:
        fields = bootstrap_fields(worker)
        handed_out.append(fields["bootstrap_room"])
        return fields

    monkeypatch.setattr(proxy, "bootstrap_fields", recorded)
    prefill = _spawn(workers, mode="prefill")
    dead, alive = _spawn(workers, mode="decode"), _spawn(workers, mode="decode")
    router = start_router(prefills=(prefill.url,), decodes=(dead.url, alive.url),
                          policy="round_robin", health_check_interval=60.0)
    dead.stop()  # the router has not noticed: its next health round is a minute away
    answers = [router.post("/generate", {"text": "x"}) for _ in range(2)]
    assert all(a.status_code == 200 and a.json()["worker"] == alive.port for a in answers)
    # one room per attempt, the retry's a new one; the prefill's request of the failed attempt
    # is cancelled with it, and may or may not have arrived
    assert len(handed_out) == 3 and len(set(handed_out)) == 3
    served = {b["bootstrap_room"] for b in alive.bodies}
    assert len(alive.bodies) == 2 and len(served) == 2 and served < set(handed_out)
    wait_until(lambda: served <= {b["bootstrap_room"] for b in prefill.bodies}, 5,
               "the prefill got the rooms of both answers")  # sent beside the decode's
    info = httpx.get(router.url + "/server_info").json()["workers"]
    assert [w["healthy"] for w in info if w["url"] == dead.url] == [False]


def test_a_5xx_is_retried_elsewhere_and_returned_when_nothing_is_left(
        start_router: Any, workers: list[FakeWorker]) -> None:
    failing, good = _spawn(workers, reply="500"), _spawn(workers)
    router = start_router(workers=(failing.url, good.url), policy="round_robin")
    assert all(router.post("/generate", {"text": "x"}).json()["worker"] == good.port
               for _ in range(3))
    good.reply = "500"
    response = router.post("/generate", {"text": "x"})
    assert response.status_code == 500 and "says 500" in response.text


def test_a_client_that_goes_away_closes_both_upstream_requests(
        start_router: Any, workers: list[FakeWorker]) -> None:
    prefill = _spawn(workers, mode="prefill", delay_s=0.5)
    decode = _spawn(workers, mode="decode", delay_s=0.5)
    router = start_router(prefills=(prefill.url,), decodes=(decode.url,))
    with httpx.stream("POST", router.url + "/generate", json={"text": "x", "stream": True},
                      timeout=10) as response:
        next(response.iter_lines())  # the first chunk, then the client is gone
    wait_until(lambda: decode.cut_off == 1 and prefill.cut_off == 1, 10,
               "both streams were closed")


def test_health_follows_the_workers(start_router: Any, workers: list[FakeWorker]) -> None:
    prefill, decode = _spawn(workers, mode="prefill"), _spawn(workers, mode="decode")
    router = start_router(prefills=(prefill.url,), decodes=(decode.url,))
    decode.healthy = False
    wait_until(lambda: _status(router.url + "/health") == 503, 5, "the router turns unhealthy")
    response = router.post("/generate", {"text": "x"})
    assert response.status_code == 503 and "could not be routed" in response.text
    decode.healthy = True
    wait_until(lambda: _status(router.url + "/health") == 200, 5, "and healthy again")
    assert router.post("/generate", {"text": "x"}).status_code == 200


def test_a_server_of_the_wrong_mode_is_never_used(start_router: Any,
                                                  workers: list[FakeWorker]) -> None:
    prefill, decode = _spawn(workers, mode="prefill"), _spawn(workers, mode="decode")
    misnamed = _spawn(workers, mode="decode")
    router = start_router(prefills=(prefill.url, misnamed.url), decodes=(decode.url,),
                          policy="round_robin")
    flagged = [w for w in httpx.get(router.url + "/server_info").json()["workers"]
               if w["problem"]]
    assert [w["url"] for w in flagged] == [misnamed.url]
    assert "given as a prefill server, but it is a decode server" in flagged[0]["problem"]
    for _ in range(3):
        assert router.post("/generate", {"text": "x"}).status_code == 200
    wait_until(lambda: len(prefill.bodies) == 3, 5,
               "the prefill got all three")  # sent beside the decode's, which answers the client
    assert len(prefill.bodies) == 3 and not misnamed.bodies


def test_a_prefill_is_paired_only_with_a_decode_of_its_model(
        start_router: Any, workers: list[FakeWorker]) -> None:
    """Any prefill with any decode of the same model (their tp and pp may differ); a prefill
    with no such decode is not used, and no pair at all leaves the router unhealthy."""
    alone = _spawn(workers, mode="prefill", model="other", bootstrap_port=9001)
    prefill = _spawn(workers, mode="prefill", model="m", bootstrap_port=9002)
    decodes = [_spawn(workers, mode="decode", model="m") for _ in range(2)]
    router = start_router(prefills=(alone.url, prefill.url),
                          decodes=tuple(d.url for d in decodes), policy="round_robin")
    for _ in range(4):
        assert router.post("/generate", {"text": "x"}).status_code == 200
    wait_until(lambda: len(prefill.bodies) == 4, 5, "the prefill of the decodes' model got all")
    assert not alone.bodies and [len(d.bodies) for d in decodes] == [2, 2]

    lonely = start_router(prefills=(alone.url,), decodes=(decodes[0].url,),
                          wait_healthy=False)
    wait_until(lambda: all(w["healthy"] for w in httpx.get(
        lonely.url + "/server_info").json()["workers"]), 5, "both workers checked, healthy")
    assert _status(lonely.url + "/health") == 503
    assert lonely.post("/generate", {"text": "x"}).status_code == 503


def test_service_discovery_follows_the_dns_records(start_router: Any, workers: list[FakeWorker],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    a = _spawn(workers)
    records: dict[str, list[str]] = {"pool": ["127.0.0.1"]}

    async def resolve(name: str) -> list[str]:
        return records.get(name, [])

    monkeypatch.setattr("shoal.router.workers.resolve", resolve)
    router = start_router(services=(f"pool:{a.port}",))
    assert router.post("/generate", {"text": "x"}).json()["worker"] == a.port
    records["pool"] = []
    wait_until(lambda: _status(router.url + "/health") == 503, 5, "the worker left")
    assert service_urls("svc:30000", ["10.0.0.2", "10.0.0.1", "10.0.0.1"]) == [
        "http://10.0.0.1:30000", "http://10.0.0.2:30000"]


def test_models_come_from_a_worker(start_router: Any, workers: list[FakeWorker]) -> None:
    worker = _spawn(workers)
    router = start_router(workers=(worker.url,))
    assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == "fake"
    assert b"shoal:router_worker_healthy" in httpx.get(router.url + "/metrics").content


