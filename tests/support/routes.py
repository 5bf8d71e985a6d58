"""The routes of the api app, enumerated from the app itself (`create_app` over a tokenizer
manager that is never started), so tests cover a route added later without naming it."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import tempfile

from fastapi.routing import APIRoute
from starlette.routing import Route
from transformers import PreTrainedTokenizerBase

from shoal.api.http_server import create_app
from shoal.api.tokenizer_manager import TokenizerManager
from shoal.config import ComponentArgs, ServerArgs

# FastAPI's own pages: not operations of the API, so not in its OpenAPI document
DOCUMENT_ROUTES = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def app_routes(args: ServerArgs, tokenizer: PreTrainedTokenizerBase) -> list[Route]:
    # the manager without metrics: its counters would be registered in the test process
    tm = TokenizerManager(dataclasses.replace(args, enable_metrics=False),
                          ComponentArgs(run_dir=tempfile.mkdtemp(prefix="shoal-routes-")),
                          tokenizer)
    try:
        routes = create_app(args, tm).routes
    finally:
        asyncio.run(tm.close())  # never started: only its sockets to close
    assert all(isinstance(route, Route) for route in routes), routes
    return [route for route in routes if isinstance(route, Route)]


def request_targets(routes: list[Route], path_value: str) -> list[tuple[str, str]]:
    """(method, path) of every route, path parameters filled with `path_value`."""
    return [(method, re.sub(r"\{[^}]+\}", path_value, route.path))
            for route in routes for method in sorted(route.methods or ()) if method != "HEAD"]


def body_models(routes: list[Route]) -> dict[str, str]:
    """Path → the name of the body model of every route that reads one."""
    return {route.path: param.field_info.annotation.__name__ for route in routes
            if isinstance(route, APIRoute) for param in route.dependant.body_params}
