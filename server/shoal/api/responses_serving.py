"""`/v1/responses`: the OpenAI Responses API over one chat-templated request.

A stream is OpenAI's event sequence: `response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta` per
chunk of text, then `response.output_text.done`, `response.content_part.done`,
`response.output_item.done`, and `response.completed` (or `response.incomplete` when
`max_output_tokens` cut it short; `response.failed` when the engine aborted it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from shoal.api.choices import checked_outputs
from shoal.api.errors import APIError, bad_request
from shoal.api.responses_protocol import (
    IncompleteDetails,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from shoal.api.sse import typed_sse_response
from shoal.api.tokenizer_manager import GenerateResult, TokenizerManager
from shoal.ipc.messages import ReqStrOut


def finished(base: ResponseObject, text: str, last: ReqStrOut | GenerateResult) -> ResponseObject:
    """`base` once its request ended with `last` (a length finish makes it incomplete)."""
    assert last.finish is not None
    complete = last.finish.kind != "length"
    message = OutputMessage(id=f"msg_{base.id.removeprefix('resp_')}",
                            status="completed" if complete else "incomplete",
                            content=[OutputText(text=text)])
    return base.model_copy(update={
        "status": "completed" if complete else "incomplete",
        "incomplete_details": None if complete else IncompleteDetails(reason="max_output_tokens"),
        "output": [message],
        "usage": ResponseUsage.of(last.prompt_tokens, last.completion_tokens, last.cached_tokens)})


class ResponsesServing:
    def __init__(self, tokenizer_manager: TokenizerManager) -> None:
        self.tm = tokenizer_manager

    async def create(self, req: ResponsesRequest, raw: Request) -> Any:
        tm = self.tm
        tm.check_model(req.model)
        tm.check_ready()
        try:
            messages = req.messages()
        except ValueError as exc:
            raise bad_request(str(exc), "input") from exc
        input_ids = tm.tokenize_chat(messages)
        sampling = req.to_sampling(tm.max_new_tokens(len(input_ids), req.max_output_tokens, None),
                                   tm.sampling_defaults)
        bootstrap = req.bootstrap()
        tm.check_disaggregation(bootstrap, [sampling])
        rid = uuid.uuid4().hex
        base = ResponseObject(id=f"resp_{rid}", created_at=int(time.time()), status="in_progress",
                              model=tm.model_name, instructions=req.instructions,
                              max_output_tokens=req.max_output_tokens,
                              temperature=req.temperature, top_p=req.top_p,
                              metadata=req.metadata or {}, user=req.user)
        if req.stream:
            outputs = tm.generate(input_ids, sampling, rid=rid, stream=True,
                                  is_disconnected=raw.is_disconnected, bootstrap=bootstrap)
            return typed_sse_response(self._events(base, outputs))
        result = await tm.generate_full(input_ids, sampling, rid=rid,
                                        is_disconnected=raw.is_disconnected, bootstrap=bootstrap)
        return finished(base, result.text, result)

    async def _events(self, base: ResponseObject,
                      outputs: AsyncIterator[ReqStrOut]) -> AsyncIterator[dict[str, Any]]:
        started = base.model_dump(mode="json")
        yield {"type": "response.created", "response": started}
        yield {"type": "response.in_progress", "response": started}
        item_id = f"msg_{base.id.removeprefix('resp_')}"
        at = {"item_id": item_id, "output_index": 0, "content_index": 0}
        yield {"type": "response.output_item.added", "output_index": 0,
               "item": OutputMessage(id=item_id, status="in_progress",
                                     content=[]).model_dump(mode="json")}
        yield {"type": "response.content_part.added", **at,
               "part": OutputText(text="").model_dump(mode="json")}
        text, last = "", None
        try:
            async for last in checked_outputs(outputs):
                if last.text:
                    yield {"type": "response.output_text.delta", **at, "delta": last.text,
                           "logprobs": []}
                    text += last.text
        except APIError as exc:
            failed = base.model_copy(update={"status": "failed", "error": ResponseError(
                code=exc.code or "server_error", message=exc.message)})
            yield {"type": "response.failed", "response": failed.model_dump(mode="json")}
            return
        if last is None or last.finish is None:
            return  # the client went away: the request was aborted
        done = finished(base, text, last)
        message = done.output[0]
        yield {"type": "response.output_text.done", **at, "text": text, "logprobs": []}
        yield {"type": "response.content_part.done", **at,
               "part": message.content[0].model_dump(mode="json")}
        yield {"type": "response.output_item.done", "output_index": 0,
               "item": message.model_dump(mode="json")}
        kind = "response.completed" if done.status == "completed" else "response.incomplete"
        yield {"type": kind, "response": done.model_dump(mode="json")}
