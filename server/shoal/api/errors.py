"""OpenAI-style errors: `{"error": {"message", "type", "code", "param"}}` for every failure.

Handlers turn FastAPI's 422 validation errors into 400s with a readable message, route misses into
404s, and any unexpected exception into a 500, so a bad request never takes the server down. The
OpenAPI document says the same: a route with a body answers a bad one with a 400 `ErrorResponse`.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shoal.api.request_fields import refusal_message

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with an HTTP status that is reported to the client as an OpenAI error body."""

    def __init__(self, status_code: int, message: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_value" if param else "invalid_request", param)


def error_type(status_code: int) -> str:
    if status_code == 401:
        return "authentication_error"
    if status_code == 404:
        return "not_found_error"
    if status_code < 500:
        return "invalid_request_error"
    return "service_unavailable" if status_code == 503 else "server_error"


def error_body(status_code: int, message: str, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status_code), "param": param,
                      "code": code if code is not None else str(status_code)}}


def error_response(error: APIError) -> JSONResponse:
    body = error_body(error.status_code, error.message, error.code, error.param)
    return JSONResponse(body, status_code=error.status_code)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line per problem, e.g. `max_tokens: Input should be a valid integer`; a field the
    request may not carry is named on its own (`request_fields.refusal_message`)."""
    lines, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"Invalid JSON body: {err.get('ctx', {}).get('error', err['msg'])}", None
        loc = [str(part) for part in err.get("loc", ()) if part != "body" and _names_a_field(part)]
        if err.get("type") == "extra_forbidden" and loc:
            return refusal_message(loc[-1]), ".".join(loc)
        param = param or (".".join(loc) or None)
        detail = err["msg"].removeprefix("Value error, ")
        lines.append(f"{'.'.join(loc) or 'body'}: {detail}")
    return "; ".join(lines) or "Invalid request", param


_UNION_MEMBER_TYPES = {"str", "int", "float", "bool", "none"}


def _names_a_field(part: str | int) -> bool:
    """A part of an error's location that names a field or an index, not the member of a union
    that was tried (`list[InputMessage]`, `ContentPart`)."""
    return isinstance(part, int) or (part.isidentifier() and not part[0].isupper()
                                     and part not in _UNION_MEMBER_TYPES)


ERROR_RESPONSE_SCHEMA: dict[str, Any] = {
    "title": "ErrorResponse", "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "string"}}}}}


def openapi_with_error_bodies(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document with each 422 (which the handlers never send) as the 400 they do."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        bad = {"description": "Bad request", "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for operations in document.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = bad
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        schemas["ErrorResponse"] = ERROR_RESPONSE_SCHEMA
        app.openapi_schema = document
    return app.openapi_schema


def install_error_handlers(app: FastAPI) -> None:
    app.openapi = lambda: openapi_with_error_bodies(app)  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(bad_request(message, param))

    @app.exception_handler(UnicodeEncodeError)
    async def _not_unicode(_: Request, exc: UnicodeEncodeError) -> JSONResponse:
        # a lone surrogate ("\\ud800") parses as JSON; the first encoder it meets refuses it
        return error_response(bad_request(f"The request holds text that is not valid Unicode: "
                                          f"{exc.reason}."))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return error_response(APIError(500, f"Internal server error: {exc}", "internal_error"))
