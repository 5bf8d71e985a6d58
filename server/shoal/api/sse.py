"""Server-sent events. Chat and completions streams: `data: {json}\\n\\n` per event, then
`data: [DONE]\\n\\n`. Responses API streams: `event: {type}\\ndata: {json}\\n\\n` per event,
each numbered by `sequence_number`, and no `[DONE]` (as OpenAI sends them)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from shoal.api.errors import APIError, error_body

logger = logging.getLogger(__name__)


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"


async def _sse(events: AsyncIterator[BaseModel | dict[str, Any]]) -> AsyncIterator[str]:
    """Headers are already sent when a stream fails, so errors become an `error` event."""
    try:
        async with aclosing(events) as stream:
            async for event in stream:
                yield sse_event(event)
    except APIError as exc:
        yield sse_event(error_body(exc.status_code, exc.message, exc.code, exc.param))
    except Exception as exc:
        logger.exception("streaming response failed")
        yield sse_event(error_body(500, f"Internal server error: {exc}", "internal_error"))
    yield "data: [DONE]\n\n"


def sse_response(events: AsyncIterator[BaseModel | dict[str, Any]]) -> StreamingResponse:
    return _streaming(_sse(events))


def typed_event(event: dict[str, Any], sequence_number: int) -> str:
    return (f"event: {event['type']}\n"
            f"data: {json.dumps(event | {'sequence_number': sequence_number})}\n\n")


async def _typed_sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Events carry their own failures (`response.failed`); anything unexpected becomes an
    `error` event."""
    sequence_number = 0
    try:
        async with aclosing(events) as stream:
            async for event in stream:
                yield typed_event(event, sequence_number)
                sequence_number += 1
    except Exception as exc:
        logger.exception("streaming response failed")
        yield typed_event({"type": "error", "code": "internal_error", "param": None,
                           "message": f"Internal server error: {exc}"}, sequence_number)


def typed_sse_response(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """A stream of typed events (dicts with a `type`): the Responses API's."""
    return _streaming(_typed_sse(events))


def _streaming(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
