"""Server-sent events: `data: {json}\\n\\n` per event, then `data: [DONE]\\n\\n`."""

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
    return StreamingResponse(_sse(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
