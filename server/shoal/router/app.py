"""The router's FastAPI app: the servers' generation routes, forwarded (`proxy.py`), and its own
`/health`, `/server_info`, `/metrics`, `/flush_cache`. With `--api-key` (or SHOAL_API_KEY),
every route but `/health*` needs `Authorization: Bearer <key>` (forwarded to the workers as it
came), and the router's own calls to the workers (`/server_info`) carry the same key."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from shoal import __version__
from shoal.api.auth import APIKeyMiddleware
from shoal.api.errors import APIError, error_response, install_error_handlers
from shoal.router.args import RouterArgs
from shoal.router.metrics import RouterMetrics
from shoal.router.proxy import FORWARDED_HEADERS, Proxy
from shoal.router.workers import WorkerPool


def create_app(args: RouterArgs) -> FastAPI:
    own = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=10.0),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=64),
                               headers=own)
    pool = WorkerPool(args, client)
    metrics = RouterMetrics()
    proxy = Proxy(args, pool, client, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        yield
        await pool.stop()
        await proxy.close()
        await client.aclose()

    app = FastAPI(title="shoal router", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    app.state.pool = pool

    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate"):
        app.add_api_route(path, _forwarder(proxy, path), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.get("/v1/models", _headers(request))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        return await proxy.get(f"/v1/models/{model_id}", _headers(request))

    @app.get("/health")
    async def health() -> Any:
        if not pool.serves:
            return error_response(APIError(503, "No healthy worker (or no healthy prefill and "
                                           "decode pair) to route to.", "service_unavailable"))
        return {"status": "ok"}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {"version": __version__, "router": {"policy": args.policy},
                "workers": [w.describe() for w in sorted(pool.workers.values(),
                                                         key=lambda w: w.url)]}

    @app.get("/metrics")
    async def router_metrics() -> Response:
        return Response(metrics.render(pool), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> JSONResponse:
        workers = [w for w in pool.workers.values() if w.usable]
        answers = await asyncio.gather(*(client.post(w.url + "/flush_cache",
                                                     headers=_headers(request))
                                         for w in workers), return_exceptions=True)
        failed = [w.url for w, a in zip(workers, answers)
                  if isinstance(a, BaseException) or a.status_code != 200]
        if failed:
            raise APIError(400, f"Cache not flushed on {', '.join(failed)}.", "flush_failed")
        return JSONResponse({"success": True, "message": f"Flushed {len(workers)} workers."})

    return app


def _forwarder(proxy: Proxy, path: str) -> Any:
    async def forward(request: Request) -> Response:
        return await proxy.generate(request, path)
    return forward


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
