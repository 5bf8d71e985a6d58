"""The api process: a FastAPI app over one `TokenizerManager`, served by uvicorn.

Routes: OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/models[/{id}]`), native
(`/generate`, `/abort_request`), and operations (`/health`, `/health_generate`, `/server_info`).
With `--api-key`, every route but `/health*` needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import dataclasses
import secrets
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from shoal import __version__
from shoal.api.errors import APIError, bad_request, error_response, install_error_handlers
from shoal.api.logprobs import native_logprobs
from shoal.api.openai_serving import OpenAIServing, checked_outputs
from shoal.api.protocol import (AbortRequest, ChatCompletionRequest, CompletionRequest,
                                GenerateRequest)
from shoal.api.sse import sse_response
from shoal.api.tokenizer_manager import GenerateResult, TokenizerManager
from shoal.config import ComponentArgs, ServerArgs
from shoal.ipc.messages import FlushCacheReq, ReqStrOut, SchedulerInfoReq, TokenLogprobs
from shoal.launch.component import StartupFailed
from shoal.metrics.api_metrics import render_metrics
from shoal.tokenizer import load_tokenizer, resolve_model_path

NATIVE_DEFAULT_MAX_NEW_TOKENS = 128


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware), so streaming and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and not scope["path"].startswith("/health")
                and not self._authorized(scope)):
            error = APIError(401, "Missing or invalid API key (expected `Authorization: Bearer "
                             "<key>`).", "invalid_api_key")
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(args: ServerArgs, tokenizer_manager: TokenizerManager) -> FastAPI:
    tm = tokenizer_manager

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tm.start()
        yield
        await tm.close()

    app = FastAPI(title="shoal", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    _add_openai_routes(app, OpenAIServing(tm))
    _add_native_routes(app, tm)
    _add_info_routes(app, args, tm)
    return app


def _add_openai_routes(app: FastAPI, serving: OpenAIServing) -> None:
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

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        serving.check_model(model_id)
        return model_card()


def native_meta(out: ReqStrOut | GenerateResult, started: float) -> dict[str, Any]:
    reason = None
    if (finish := out.finish) is not None:
        matched = finish.matched_str if finish.matched_str is not None else finish.matched_token
        reason = {"type": finish.kind, "matched": matched}
        if finish.kind == "length":
            reason["length"] = out.completion_tokens
        if finish.kind == "abort":
            reason["message"] = finish.message
    return {"id": out.rid, "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens, "cached_tokens": out.cached_tokens,
            "finish_reason": reason, "e2e_latency": time.monotonic() - started}


def native_logprob_meta(tm: TokenizerManager, req: GenerateRequest, input_ids: list[int],
                        output_ids: list[int], logprobs: TokenLogprobs | None,
                        prompt_logprobs: TokenLogprobs | None) -> dict[str, Any]:
    """SGLang's logprob fields of meta_info: `output_token_logprobs` and `output_top_logprobs`,
    and with `logprob_start_len >= 0` the `input_*` ones from that prompt position on."""
    meta: dict[str, Any] = {}
    if logprobs is not None:
        meta["output_token_logprobs"], meta["output_top_logprobs"] = native_logprobs(
            tm, output_ids, logprobs, req.return_text_in_logprobs)
    if prompt_logprobs is not None:
        start = min(req.logprob_start_len, len(input_ids) - 1)
        meta["input_token_logprobs"], meta["input_top_logprobs"] = native_logprobs(
            tm, input_ids[start:], prompt_logprobs, req.return_text_in_logprobs,
            unscored_first=True)
    return meta


def _native_input_ids(tm: TokenizerManager, req: GenerateRequest) -> list[int]:
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("Exactly one of `text` and `input_ids` must be given.")
    input_ids = tm.tokenize(req.text) if req.text is not None else list(req.input_ids or [])
    tm.check_token_ids(input_ids, "text" if req.text is not None else "input_ids")
    return input_ids


def _add_native_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/generate")
    async def generate(req: GenerateRequest, raw: Request) -> Any:
        tm.check_ready()
        input_ids = _native_input_ids(tm, req)
        params = req.sampling_params
        tm.check_token_ids(params.stop_token_ids or [], "stop_token_ids", allow_empty=True)
        tm.check_token_ids(params.logit_bias_ids, "logit_bias", allow_empty=True)
        max_new = tm.max_new_tokens(len(input_ids), params.max_new_tokens,
                                    NATIVE_DEFAULT_MAX_NEW_TOKENS)
        sampling, started = params.to_sampling(max_new), time.monotonic()
        if req.stream:
            outputs = tm.generate(input_ids, sampling, rid=req.rid, stream=True,
                                  logprob=req.logprob_params(),
                                  is_disconnected=raw.is_disconnected)
            return sse_response(_native_stream(tm, req, input_ids, outputs, started))
        result = await tm.generate_full(input_ids, sampling, rid=req.rid,
                                        logprob=req.logprob_params(),
                                        is_disconnected=raw.is_disconnected)
        meta = native_meta(result, started) | native_logprob_meta(
            tm, req, input_ids, result.output_ids, result.logprobs, result.prompt_logprobs)
        return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest) -> dict[str, Any]:
        if req.abort_all:
            tm.abort_all()
        elif req.rid:
            tm.abort(req.rid)
        else:
            raise bad_request("Give `rid` or `abort_all: true`.", "rid")
        return {"success": True}


async def _native_stream(tm: TokenizerManager, req: GenerateRequest, input_ids: list[int],
                         outputs: AsyncIterator[ReqStrOut],
                         started: float) -> AsyncIterator[dict[str, Any]]:
    """SGLang-style chunks: `text`, `output_ids` and logprobs are cumulative, as in SGLang's
    /generate."""
    text, output_ids = "", []
    logprobs = TokenLogprobs() if req.return_logprob else None
    prompt_logprobs: TokenLogprobs | None = None
    async for out in checked_outputs(outputs):
        text += out.text
        output_ids += out.new_ids
        if logprobs is not None and out.logprobs is not None:
            logprobs.extend(out.logprobs)
        prompt_logprobs = prompt_logprobs or out.prompt_logprobs
        meta = native_meta(out, started) | native_logprob_meta(
            tm, req, input_ids, output_ids, logprobs, prompt_logprobs)
        yield {"text": text, "output_ids": output_ids, "meta_info": meta}


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


def run_api(args: ServerArgs, component: ComponentArgs) -> None:
    """Run the api process until uvicorn stops (SIGINT/SIGTERM); `shoal component api` sets the
    process title, logging and the exit code around it."""
    try:
        tokenizer = load_tokenizer(resolve_model_path(args))
    except (OSError, ValueError) as exc:
        raise StartupFailed(f"cannot load the tokenizer: {exc}") from exc
    tm = TokenizerManager(args, component, tokenizer)
    app = create_app(args, tm)
    # NOTE: uvicorn shuts down gracefully on SIGTERM, then re-raises the signal to the previous
    # handler; this one turns it into a clean exit (0) instead of death by signal.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                access_log=args.log_level.lower() == "debug", timeout_keep_alive=5)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)
