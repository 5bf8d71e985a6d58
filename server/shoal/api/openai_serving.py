"""`/v1/chat/completions` and `/v1/completions`: OpenAI bodies in, OpenAI objects or SSE out.

Streams follow OpenAI: the first chat delta carries `role: "assistant"`, the choice gets exactly
one chunk with a non-null `finish_reason`, `stream_options.include_usage` adds a last chunk with
`usage` and no choices, and `data: [DONE]` ends the stream.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from shoal.api.errors import APIError, bad_request
from shoal.api.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk,
                                ChatCompletionRequest, ChatCompletionResponse, ChatMessage,
                                ChatStreamChoice, CompletionChoice, CompletionRequest,
                                CompletionResponse, DeltaMessage, Usage)
from shoal.api.sse import sse_response
from shoal.api.tokenizer_manager import GenerateResult, TokenizerManager
from shoal.ipc.messages import FinishReason, ReqStrOut


def finish_reason(finish: FinishReason | None) -> str | None:
    return None if finish is None else finish.kind


def matched_stop(finish: FinishReason | None) -> int | str | None:
    if finish is None or finish.kind != "stop":
        return None
    return finish.matched_str if finish.matched_str is not None else finish.matched_token


def usage_of(out: ReqStrOut | GenerateResult) -> Usage:
    return Usage.of(out.prompt_tokens, out.completion_tokens, out.cached_tokens)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template; `developer` is OpenAI's newer name for `system`."""
    try:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in messages]
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc


class OpenAIServing:
    def __init__(self, tokenizer_manager: TokenizerManager) -> None:
        self.tm = tokenizer_manager

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.tm.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model_not_found", "model")

    async def chat_completions(self, req: ChatCompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        self.tm.check_ready()
        input_ids = self.tm.tokenize_chat(chat_messages(req.messages))
        max_new = self.tm.max_new_tokens(len(input_ids), req.requested_max_tokens, None)
        self._check_stop_ids(req.stop_token_ids)
        rid, created = uuid.uuid4().hex, int(time.time())
        if req.stream:
            outputs = self.tm.generate(input_ids, req.to_sampling(max_new), rid=rid, stream=True,
                                       is_disconnected=raw.is_disconnected)
            return sse_response(self._chat_stream(req, outputs, f"chatcmpl-{rid}", created))
        result = await self.tm.generate_full(input_ids, req.to_sampling(max_new), rid=rid,
                                             is_disconnected=raw.is_disconnected)
        choice = ChatChoice(message=AssistantMessage(content=result.text),
                            finish_reason=finish_reason(result.finish),
                            matched_stop=matched_stop(result.finish))
        return ChatCompletionResponse(id=f"chatcmpl-{rid}", created=created,
                                      model=self.tm.model_name, choices=[choice],
                                      usage=usage_of(result))

    async def _chat_stream(self, req: ChatCompletionRequest, outputs: AsyncIterator[ReqStrOut],
                           cid: str, created: int) -> AsyncIterator[BaseModel]:
        def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> BaseModel:
            return ChatCompletionChunk(id=cid, created=created, model=self.tm.model_name,
                                       choices=choices, usage=usage)

        yield chunk([ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))])
        async for out in checked_outputs(outputs):
            if out.text or out.finish is not None:
                yield chunk([ChatStreamChoice(delta=DeltaMessage(content=out.text or None),
                                              finish_reason=finish_reason(out.finish),
                                              matched_stop=matched_stop(out.finish))])
            if out.finish is not None and req.include_usage:
                yield chunk([], usage_of(out))

    async def completions(self, req: CompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        self.tm.check_ready()
        if isinstance(req.prompt, str):
            input_ids = self.tm.tokenize(req.prompt)
        else:
            input_ids = list(req.prompt)
        self.tm.check_token_ids(input_ids, "prompt")
        max_new = self.tm.max_new_tokens(len(input_ids), req.max_tokens, None)
        self._check_stop_ids(req.stop_token_ids)
        echo = self._prompt_text(req, input_ids) if req.echo else ""
        rid, created = uuid.uuid4().hex, int(time.time())
        if req.stream:
            outputs = self.tm.generate(input_ids, req.to_sampling(max_new), rid=rid, stream=True,
                                       is_disconnected=raw.is_disconnected)
            return sse_response(self._completion_stream(req, outputs, f"cmpl-{rid}", created, echo))
        result = await self.tm.generate_full(input_ids, req.to_sampling(max_new), rid=rid,
                                             is_disconnected=raw.is_disconnected)
        choice = CompletionChoice(text=echo + result.text,
                                  finish_reason=finish_reason(result.finish),
                                  matched_stop=matched_stop(result.finish))
        return CompletionResponse(id=f"cmpl-{rid}", created=created, model=self.tm.model_name,
                                  choices=[choice], usage=usage_of(result))

    async def _completion_stream(self, req: CompletionRequest, outputs: AsyncIterator[ReqStrOut],
                                 cid: str, created: int, echo: str) -> AsyncIterator[BaseModel]:
        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> BaseModel:
            return CompletionResponse(id=cid, created=created, model=self.tm.model_name,
                                      choices=choices, usage=usage)

        if echo:
            yield chunk([CompletionChoice(text=echo)])
        async for out in checked_outputs(outputs):
            if out.text or out.finish is not None:
                yield chunk([CompletionChoice(text=out.text,
                                              finish_reason=finish_reason(out.finish),
                                              matched_stop=matched_stop(out.finish))])
            if out.finish is not None and req.include_usage:
                yield chunk([], usage_of(out))

    def _prompt_text(self, req: CompletionRequest, input_ids: list[int]) -> str:
        return req.prompt if isinstance(req.prompt, str) else self.tm.decode(input_ids)

    def _check_stop_ids(self, stop_token_ids: list[int] | None) -> None:
        self.tm.check_token_ids(stop_token_ids or [], "stop_token_ids", allow_empty=True)


async def checked_outputs(outputs: AsyncIterator[ReqStrOut]) -> AsyncIterator[ReqStrOut]:
    """The chunks of one request; an aborted request raises (the stream reports an error)."""
    async with aclosing(outputs) as stream:
        async for out in stream:
            if out.finish is not None and out.finish.kind == "abort":
                raise APIError(500, out.finish.message or "The request was aborted.", "aborted")
            yield out
