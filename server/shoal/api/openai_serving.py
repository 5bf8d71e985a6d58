"""`/v1/chat/completions` and `/v1/completions`: OpenAI bodies in, OpenAI objects or SSE out.

Streams follow OpenAI: the first chat delta of each choice carries `role: "assistant"`, each
choice gets exactly one chunk with a non-null `finish_reason`, every chunk names its choice by
`index`, `stream_options.include_usage` adds a last chunk with `usage` and no choices (vLLM's
`continuous_usage_stats` puts the usage so far on every chunk of output too), and
`data: [DONE]` ends the stream. With `n` choices, usage counts each prompt once and the
completion tokens of all choices. A batch of prompts (`/v1/completions`) gives choice
`prompt index * n + sample`; closing the stream, or the client going away, aborts every choice.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from shoal.api import logprobs as render
from shoal.api.choices import Choices, merge_streams
from shoal.api.errors import bad_request
from shoal.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    Usage,
)
from shoal.api.sse import sse_response
from shoal.api.tokenizer_manager import GenerateResult, TokenizerManager
from shoal.api.tool_calls import parse_tool_calls, with_fallback_prompt
from shoal.ipc.messages import FinishReason, LogprobParams, ReqStrOut


def finish_reason(finish: FinishReason | None) -> str | None:
    return None if finish is None else finish.kind


def matched_stop(finish: FinishReason | None) -> int | str | None:
    if finish is None or finish.kind != "stop":
        return None
    return finish.matched_str if finish.matched_str is not None else finish.matched_token


def usage_of(outs: Mapping[int, ReqStrOut | GenerateResult], n: int) -> Usage:
    """The usage so far, from the latest output of each choice (choice i is a sample of prompt
    i // n): each prompt counts once, completions add up."""
    firsts: dict[int, ReqStrOut | GenerateResult] = {}
    for i in sorted(outs):
        firsts.setdefault(i // n, outs[i])
    return Usage.of(sum(out.prompt_tokens for out in firsts.values()),
                    sum(out.completion_tokens for out in outs.values()),
                    sum(out.cached_tokens for out in firsts.values()))


def chat_messages(messages: list[ChatMessage], renders_tools: bool) -> list[dict[str, Any]]:
    """Messages for the chat template; when it has no place for tool calls, an assistant
    message's calls are its content, as `tool_calls.fallback_prompt` asks the model to write
    them."""
    try:
        rendered = [m.template_message() for m in messages]
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc
    if renders_tools:
        return rendered
    return [{"role": m["role"], "content": m["content"] or json.dumps(
                [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in m["tool_calls"]])} if m.get("tool_calls") else
            {"role": m["role"], "content": m["content"]} for m in rendered]


def assistant_turn(text: str, finish: FinishReason | None,
                   functions: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]],
                                                             str | None]:
    """(content, tool calls, finish_reason) of a finished output; the calls are parsed when the
    request offers functions (`tool_calls.parse_tool_calls`)."""
    calls: list[dict[str, Any]] = []
    content: str | None = text
    if functions and finish is not None and finish.kind == "stop":
        content, calls = parse_tool_calls(text, {f["name"] for f in functions})
    return content, calls, "tool_calls" if calls else finish_reason(finish)


class OpenAIServing:
    def __init__(self, tokenizer_manager: TokenizerManager) -> None:
        self.tm = tokenizer_manager

    async def _choices(self, req: ChatCompletionRequest | CompletionRequest,
                       prompts: list[list[int]], logprob: LogprobParams | None,
                       raw: Request) -> Choices:
        """Check what the model must check, then warm the prompts up for n > 1."""
        samplings = [req.to_sampling(self.tm.max_new_tokens(len(ids), req.requested_max_tokens,
                                                            None), self.tm.sampling_defaults)
                     for ids in prompts]
        self.tm.check_token_ids(req.stop_token_ids or [], "stop_token_ids", allow_empty=True)
        self.tm.check_token_ids(req.logit_bias_ids, "logit_bias", allow_empty=True)
        bootstrap = req.bootstrap()
        self.tm.check_disaggregation(bootstrap, samplings)
        if bootstrap is not None and len(prompts) * req.n > 1:
            raise bad_request("A request paired by `shoal router` (bootstrap_room) has one "
                              "prompt and n = 1.", "bootstrap_room")
        choices = Choices(self.tm, uuid.uuid4().hex, prompts, samplings, req.n, logprob,
                          raw.is_disconnected, bootstrap)
        await choices.warm_prefix()
        return choices

    # ---- chat -----------------------------------------------------------------------------------

    async def chat_completions(self, req: ChatCompletionRequest, raw: Request) -> Any:
        self.tm.check_model(req.model)
        self.tm.check_ready()
        input_ids = self._chat_prompt(req)
        choices = await self._choices(req, [input_ids], req.logprob_params(), raw)
        cid, created = f"chatcmpl-{choices.rid}", int(time.time())
        if req.stream:
            return sse_response(self._chat_stream(req, choices.streams(), cid, created))
        results = await choices.results()
        functions = req.callable_functions()
        turns = [assistant_turn(r.text, r.finish, functions) for r in results]
        return ChatCompletionResponse(
            id=cid, created=created, model=self.tm.model_name,
            usage=usage_of(dict(enumerate(results)), req.n),
            choices=[ChatChoice(index=i, message=AssistantMessage(content=content,
                                                                  tool_calls=calls or None),
                                logprobs=self._chat_logprobs(result.output_ids, result),
                                finish_reason=reason, matched_stop=matched_stop(result.finish))
                     for i, (result, (content, calls, reason)) in enumerate(zip(results, turns))])

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """The prompt's ids: the messages, and the functions the model may call (through the
        template, or `tool_calls.with_fallback_prompt`)."""
        functions, renders_tools = req.callable_functions(), self.tm.template_renders_tools
        messages, options = chat_messages(req.messages, renders_tools), req.template_options
        if not functions:
            return self.tm.tokenize_chat(messages, options=options)
        if renders_tools:
            return self.tm.tokenize_chat(messages, [{"type": "function", "function": f}
                                                    for f in functions], options)
        return self.tm.tokenize_chat(with_fallback_prompt(messages, functions), options=options)

    def _chat_logprobs(self, ids: list[int], out: ReqStrOut | GenerateResult) -> Any:
        return None if out.logprobs is None else render.chat_logprobs(self.tm, ids, out.logprobs)

    async def _chat_stream(self, req: ChatCompletionRequest,
                           streams: list[AsyncIterator[ReqStrOut]], cid: str,
                           created: int) -> AsyncIterator[BaseModel]:
        def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> BaseModel:
            return ChatCompletionChunk(id=cid, created=created, model=self.tm.model_name,
                                       choices=choices, usage=usage)

        for i in range(len(streams)):
            yield chunk([ChatStreamChoice(index=i,
                                          delta=DeltaMessage(role="assistant", content=""))])
        last: dict[int, ReqStrOut] = {}
        functions = req.callable_functions()
        held: dict[int, str] = {}  # with functions, each choice's text until it finishes
        async for i, out in merge_streams(streams):
            last[i] = out
            usage = usage_of(last, req.n) if req.continuous_usage else None
            logprobs = self._chat_logprobs(out.new_ids, out) if out.new_ids else None
            if functions:
                held[i] = held.get(i, "") + out.text
                if out.finish is not None:
                    yield chunk([self._tool_turn_chunk(i, held.pop(i), out, functions)], usage)
            elif out.text or out.finish is not None or logprobs is not None:
                yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(content=out.text or None),
                                              logprobs=logprobs,
                                              finish_reason=finish_reason(out.finish),
                                              matched_stop=matched_stop(out.finish))], usage)
        if req.include_usage and last:
            yield chunk([], usage_of(last, req.n))

    @staticmethod
    def _tool_turn_chunk(index: int, text: str, last: ReqStrOut,
                         functions: list[dict[str, Any]]) -> ChatStreamChoice:
        """The one delta of a choice that may call functions: its content or its calls (each
        whole, with its `index`), sent when the output is complete and parses."""
        content, calls, reason = assistant_turn(text, last.finish, functions)
        return ChatStreamChoice(index=index, delta=DeltaMessage(
            content=content or None,
            tool_calls=[{"index": k, **call} for k, call in enumerate(calls)] or None),
            finish_reason=reason, matched_stop=matched_stop(last.finish))

    # ---- completions ----------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, raw: Request) -> Any:
        self.tm.check_model(req.model)
        self.tm.check_ready()
        prompts = [self.tm.tokenize(p) if isinstance(p, str) else list(p) for p in req.prompts]
        for ids in prompts:
            self.tm.check_token_ids(ids, "prompt")
        choices = await self._choices(req, prompts, req.logprob_params(), raw)
        echoes = [self._prompt_text(p, ids) if req.echo else ""
                  for p, ids in zip(req.prompts, prompts)]
        cid, created = f"cmpl-{choices.rid}", int(time.time())
        if req.stream:
            return sse_response(self._completion_stream(req, choices, choices.streams(), cid,
                                                        created, echoes))
        results = await choices.results()
        return CompletionResponse(
            id=cid, created=created, model=self.tm.model_name,
            usage=usage_of(dict(enumerate(results)), req.n),
            choices=[CompletionChoice(
                index=i, text=echoes[i // req.n] + result.text,
                logprobs=self._completion_logprobs(choices.prompt_of(i), result,
                                                   echoes[i // req.n], result.output_ids),
                finish_reason=finish_reason(result.finish),
                matched_stop=matched_stop(result.finish))
                for i, result in enumerate(results)])

    def _completion_logprobs(self, input_ids: list[int], out: ReqStrOut | GenerateResult,
                             echo: str, ids: list[int], offset: int = 0,
                             with_prompt: bool = True) -> CompletionLogprobs | None:
        """Logprobs of `ids` (starting at `offset` in the choice's text), after those of the
        echoed prompt when `with_prompt` and the request echoes."""
        if out.logprobs is None:
            return None
        prompt = None
        if with_prompt and echo and out.prompt_logprobs is not None:
            prompt = render.completion_logprobs(self.tm, input_ids, out.prompt_logprobs,
                                                unscored_first=True)
            offset = len(echo)
        generated = render.completion_logprobs(self.tm, ids, out.logprobs, offset)
        return generated if prompt is None else render.join(prompt, generated)

    async def _completion_stream(self, req: CompletionRequest, choices: Choices,
                                 streams: list[AsyncIterator[ReqStrOut]], cid: str, created: int,
                                 echoes: list[str]) -> AsyncIterator[BaseModel]:
        def chunk(items: list[CompletionChoice], usage: Usage | None = None) -> BaseModel:
            return CompletionResponse(id=cid, created=created, model=self.tm.model_name,
                                      choices=items, usage=usage)

        text_len: dict[int, int] = {}  # characters of each choice's text sent so far
        last: dict[int, ReqStrOut] = {}
        async for i, out in merge_streams(streams):
            echo, input_ids = echoes[i // req.n], choices.prompt_of(i)
            if i not in text_len:
                text_len[i] = len(echo)
                if echo:  # sent with the first output, which brings the prompt's logprobs
                    prompt = None
                    if out.prompt_logprobs is not None:
                        prompt = render.completion_logprobs(
                            self.tm, input_ids, out.prompt_logprobs, unscored_first=True)
                    yield chunk([CompletionChoice(index=i, text=echo, logprobs=prompt)])
            last[i] = out
            logprobs = self._completion_logprobs(input_ids, out, echo, out.new_ids, text_len[i],
                                                 with_prompt=False) if out.new_ids else None
            if out.text or out.finish is not None or logprobs is not None:
                yield chunk([CompletionChoice(index=i, text=out.text, logprobs=logprobs,
                                              finish_reason=finish_reason(out.finish),
                                              matched_stop=matched_stop(out.finish))],
                            usage_of(last, req.n) if req.continuous_usage else None)
            text_len[i] += len(out.text)
        if req.include_usage and last:
            yield chunk([], usage_of(last, req.n))

    def _prompt_text(self, prompt: str | list[int], input_ids: list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.tm.decode(input_ids)
