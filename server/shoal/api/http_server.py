"""The api process's FastAPI app over one `TokenizerManager`: every route, in one place.

Routes: OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/models[/{id}]`;
`openai_serving.py`; `/v1/responses`: `responses_serving.py`; `/v1/embeddings`:
`embeddings_serving.py`), native (`/generate`,
`/abort_request`; `native_serving.py`), and operations
(`/health`, `/health_generate`, `/server_info`, `/flush_cache`, `/metrics`). With `--api-key`,
every route but `/health*` needs `Authorization: Bearer <key>` (`auth.py`). With
`--max-queued-requests`, generation requests beyond the bound get 429 (`backpressure.py`).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from shoal import __version__
from shoal.api.auth import APIKeyMiddleware
from shoal.api.backpressure import BackpressureMiddleware
from shoal.api.embeddings_protocol import EmbeddingRequest, EmbeddingResponse
from shoal.api.embeddings_serving import EmbeddingServing
from shoal.api.errors import APIError, bad_request, error_response, install_error_handlers
from shoal.api.native_serving import NativeServing
from shoal.api.openai_serving import OpenAIServing
from shoal.api.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from shoal.api.responses_protocol import ResponsesRequest
from shoal.api.responses_serving import ResponsesServing
from shoal.api.tokenizer_manager import TokenizerManager
from shoal.config import ServerArgs
from shoal.ipc.messages import FlushCacheReq, SchedulerInfoReq
from shoal.metrics.api_metrics import render_metrics


def create_app(args: ServerArgs, tokenizer_manager: TokenizerManager) -> FastAPI:
    tm = tokenizer_manager

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tm.start()
        yield
        await tm.close()

    app = FastAPI(title="shoal", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    if args.max_queued_requests is not None:  # inside the key check: a 401 before a 429
        app.add_middleware(BackpressureMiddleware, max_queued_requests=args.max_queued_requests,
                           max_running_requests=lambda: tm.limits()["max_running_requests"],
                           enable_metrics=args.enable_metrics)
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    _add_openai_routes(app, OpenAIServing(tm), ResponsesServing(tm))
    _add_embedding_routes(app, EmbeddingServing(tm))
    _add_native_routes(app, NativeServing(tm))
    _add_info_routes(app, args, tm)
    return app


def _add_openai_routes(app: FastAPI, serving: OpenAIServing,
                       responses: ResponsesServing) -> None:
    created = int(time.time())

    def model_card() -> dict[str, Any]:
        return {"id": serving.tm.model_name, "object": "model", "created": created,
                "owned_by": "shoal", "root": serving.tm.model_name,
                "max_model_len": serving.tm.context_length}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        return await serving.chat_completions(req, raw)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        return await serving.completions(req, raw)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request) -> Any:
        return await responses.create(req, raw)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        serving.tm.check_model(model_id)
        return model_card()


def _add_embedding_routes(app: FastAPI, serving: EmbeddingServing) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest) -> EmbeddingResponse:
        return await serving.create(req)


def _add_native_routes(app: FastAPI, serving: NativeServing) -> None:
    @app.post("/generate")
    async def generate(req: GenerateRequest, raw: Request) -> Any:
        return await serving.generate(req, raw)

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest) -> dict[str, Any]:
        if req.abort_all:
            serving.tm.abort_all()
        elif req.rid:
            serving.tm.abort(req.rid)
        else:
            raise bad_request("Give `rid` or `abort_all: true`.", "rid")
        return {"success": True}


def _add_info_routes(app: FastAPI, args: ServerArgs, tm: TokenizerManager) -> None:
    def unavailable(message: str) -> JSONResponse:
        return error_response(APIError(503, message, "service_unavailable"))

    @app.get("/health")
    async def health() -> Any:
        if not tm.is_ready:
            return unavailable(f"Waiting for: {', '.join(tm.missing_components)}.")
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate() -> Any:
        if not await tm.health_generate():
            return unavailable("Health generation failed or the server is not ready.")
        return {"status": "ok"}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        resolved = dataclasses.asdict(args)
        if resolved["api_key"]:
            resolved["api_key"] = "<redacted>"
        pool = (await tm.control(SchedulerInfoReq(rid=_control_rid()))).info if tm.is_ready \
            else None
        return {**resolved, "version": __version__, "served_model_name": tm.model_name,
                "limits": tm.limits(), "ready_components": sorted(tm.ready),
                "num_running_requests": len(tm.rid_to_state), "scheduler": pool}

    if args.enable_metrics:
        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        reply = await tm.control(FlushCacheReq(rid=_control_rid()))
        if not reply.ok:
            raise bad_request(f"Cache not flushed: {reply.message}.")
        return JSONResponse({"success": True, "message": "The prefix cache was flushed."})


def _control_rid() -> str:
    return f"control-{uuid.uuid4().hex}"
