"""`--max-queued-requests`: the api's bound on generation requests held at once (429 beyond)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from shoal.api.backpressure import BackpressureMiddleware, admission_limit


@pytest.mark.parametrize("running,queued,limit", [(4, 4, 8), (None, 3, 3), (256, 0, 256)])
def test_admission_limit(running: int | None, queued: int, limit: int) -> None:
    assert admission_limit(running, queued) == limit


def make_app(release: asyncio.Event) -> tuple[Starlette, BackpressureMiddleware]:
    async def generate(request: Request) -> JSONResponse:
        await request.json()
        await release.wait()
        return JSONResponse({"ok": True})

    async def stream(_: Request) -> StreamingResponse:
        async def chunks():
            yield "data: 1\n\n"
            await release.wait()
            yield "data: [DONE]\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def info(_: Request) -> JSONResponse:
        return JSONResponse({"info": True})

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"]),
                           Route("/v1/completions", stream, methods=["POST"]),
                           Route("/server_info", info)])
    middleware = BackpressureMiddleware(app, max_queued_requests=2,
                                        max_running_requests=lambda: 1)
    return app, middleware


def test_excess_requests_get_429_at_once_and_admitted_ones_complete() -> None:
    async def run() -> None:
        release = asyncio.Event()
        _, middleware = make_app(release)
        transport = httpx.ASGITransport(app=middleware)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            tasks = [asyncio.create_task(client.post("/generate", json={"i": i}))
                     for i in range(10)]
            await asyncio.sleep(0.2)
            rejected = [t.result() for t in tasks if t.done()]
            assert len(rejected) == 7 and middleware.num_in_flight == 3
            for r in rejected:
                assert r.status_code == 429 and r.headers["Retry-After"] == "1"
                assert r.json()["error"]["code"] == "too_many_requests"
            assert (await client.get("/server_info")).status_code == 200
            release.set()
            admitted = await asyncio.gather(*(t for t in tasks if not t.done()))
            assert [r.status_code for r in admitted] == [200] * 3
            assert middleware.num_in_flight == 0

    asyncio.run(run())


def test_a_stream_holds_its_place_until_it_ends() -> None:
    async def run() -> None:
        release = asyncio.Event()
        _, middleware = make_app(release)
        transport = httpx.ASGITransport(app=middleware)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            streams = [asyncio.create_task(client.post("/v1/completions", json={}))
                       for _ in range(3)]
            await asyncio.sleep(0.2)
            assert middleware.num_in_flight == 3
            assert (await client.post("/v1/completions", json={})).status_code == 429
            release.set()
            assert [r.status_code for r in await asyncio.gather(*streams)] == [200] * 3
            assert middleware.num_in_flight == 0
            assert (await client.post("/v1/completions", json={})).status_code == 200

    asyncio.run(run())
