"""The api process's side of the engine: tokenize, check limits, submit, and route outputs back.

Every in-flight request has a `ReqState` whose queue receives that request's `ReqStrOut` chunks.
The event loop (uvicorn's) reads the api PULL socket whenever its descriptor signals
(`_drain`), routing `BatchStrOut` chunks by rid and `ComponentReady` into the readiness table.
`start()` registers that reader on the running loop, so constructing a manager needs no event
loop. A plain socket read until it is empty, not `zmq.asyncio`: at one stream every token is a
message, and this and the disconnect watcher below cut the api's CPU a streamed token
(docs/perf-log.md).

A request whose client goes away is aborted: `generate`'s iterator sends an `AbortReq` when it is
closed or cancelled before the request finished, and while it runs a task of its own polls
`is_disconnected`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from shoal.api.embedding_client import EmbeddingClient
from shoal.api.errors import APIError, bad_request
from shoal.config import ComponentArgs, ServerArgs
from shoal.ipc import sockets
from shoal.ipc.messages import (
    AbortReq,
    BatchEmbeddingOut,
    BatchStrOut,
    BootstrapInfo,
    ComponentReady,
    ControlReply,
    FinishReason,
    FlushCacheReq,
    GenerateReq,
    LogprobParams,
    Message,
    ReqStrOut,
    SamplingParams,
    SchedulerInfoReq,
    TokenLogprobs,
    decode,
)
from shoal.metrics.api_metrics import RequestMetrics
from shoal.tokenizer import (
    OPENAI_DEFAULTS,
    SamplingDefaults,
    max_chars_per_token,
    served_model_name,
)

logger = logging.getLogger(__name__)

REQUIRED_COMPONENTS = ("scheduler", "detokenizer")
FALLBACK_MAX_NEW_TOKENS = 128  # used only while no context length is known
HEALTH_CHECK_TIMEOUT_S = 20.0
CONTROL_TIMEOUT_S = 10.0

IsDisconnected = Callable[[], Awaitable[bool]]


@dataclass
class ReqState:
    queue: asyncio.Queue[ReqStrOut | None] = field(default_factory=asyncio.Queue)  # None: gone
    finished: bool = False
    created_at: float = field(default_factory=time.monotonic)
    last_output_at: float | None = None


@dataclass(frozen=True)
class GenerateResult:
    """A whole (non-streamed) request: the concatenation of its chunks and the final counts."""

    rid: str
    text: str
    output_ids: list[int]
    finish: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float
    logprobs: TokenLogprobs | None = None         # of output_ids, when asked
    prompt_logprobs: TokenLogprobs | None = None  # from logprob_start_len on, when asked


@dataclass
class Accumulated:
    """A request's chunks so far, concatenated: text, output ids and log-probabilities."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: TokenLogprobs | None = None         # None: the request asked for none
    prompt_logprobs: TokenLogprobs | None = None  # they come once, with the first chunk

    @classmethod
    def expecting(cls, logprobs: bool) -> Accumulated:
        return cls(logprobs=TokenLogprobs() if logprobs else None)

    def add(self, out: ReqStrOut) -> None:
        self.text += out.text
        self.output_ids += out.new_ids
        if self.logprobs is not None and out.logprobs is not None:
            self.logprobs.extend(out.logprobs)
        self.prompt_logprobs = self.prompt_logprobs or out.prompt_logprobs


def unicode_text(text: str, param: str) -> str:
    """`text`, or a 400 when it is not Unicode text: JSON may carry a lone surrogate ("\\ud800")
    that no encoder (the tokenizer's, msgspec's) accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"The text is not valid Unicode: {exc.reason} at position "
                          f"{exc.start}.", param) from exc
    return text


def abort_error(finish: FinishReason) -> APIError:
    """What the client is told of an aborted request: a 400 when the scheduler refused it as
    given, else a 500."""
    message = finish.message or "The request was aborted."
    if finish.refused:
        return bad_request(f"The request cannot be served: {message}.")
    return APIError(500, message, "aborted")


def fit_max_new_tokens(prompt_len: int, requested: int | None, default: int | None,
                       context_length: int | None) -> int:
    """How many new tokens a request may generate, or a 400 when it cannot fit the context.

    `requested` is what the client asked for (None: not given). Without a request, the answer is
    `default` (None: everything the context leaves), clipped to the room left; an explicit request
    that does not fit is an error, as with OpenAI.
    """
    if context_length is None:
        return requested or default or FALLBACK_MAX_NEW_TOKENS
    if prompt_len >= context_length:
        raise bad_request(f"The input ({prompt_len} tokens) is longer than the model's context "
                          f"length ({context_length} tokens).")
    room = context_length - prompt_len
    if requested is None:
        return min(default, room) if default else room
    if requested > room:
        raise bad_request(
            f"Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of {prompt_len + requested} tokens: "
            f"{prompt_len} tokens from the input and {requested} tokens for the completion. "
            f"Please reduce the input or the completion to fit within the limit.", "max_tokens")
    return requested


class TokenizerManager:
    def __init__(self, args: ServerArgs, component: ComponentArgs,
                 tokenizer: PreTrainedTokenizerBase,
                 required_components: Sequence[str] = REQUIRED_COMPONENTS,
                 disconnect_poll_s: float = 1.0,
                 sampling_defaults: SamplingDefaults = OPENAI_DEFAULTS) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.sampling_defaults = sampling_defaults  # for the fields a request leaves out
        self.vocab_size = len(tokenizer)
        self.model_name = served_model_name(args)
        self.required_components = tuple(required_components)
        self.ready: dict[str, ComponentReady] = {}
        self.rid_to_state: dict[str, ReqState] = {}
        self.last_receive_time = 0.0
        self.disconnect_poll_s = disconnect_poll_s
        endpoints = sockets.Endpoints(component.run_dir)
        self._context = zmq.Context()
        self._recv_sock = sockets.pull_socket(self._context, endpoints.api_input)
        self._send_sock = sockets.push_socket(self._context, endpoints.scheduler_input)
        self._loop: asyncio.AbstractEventLoop | None = None  # the one reading, once started
        self._pending_replies: dict[str, asyncio.Future[ControlReply]] = {}
        self._token_texts: dict[int, str] = {}
        self.max_token_chars = max_chars_per_token(tokenizer)
        self.metrics = RequestMetrics() if args.enable_metrics else None
        self.embeddings = EmbeddingClient(self._send)

    # ---- lifecycle and readiness ----------------------------------------------------------------

    def start(self) -> None:
        """Read the api socket on the running event loop from now on (idempotent)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._recv_sock.getsockopt(zmq.FD), self._drain)
            self._drain()  # what came before the reader, which its descriptor signalled already

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._recv_sock.getsockopt(zmq.FD))
        self._context.destroy(linger=0)

    @property
    def missing_components(self) -> list[str]:
        return [name for name in self.required_components if name not in self.ready]

    @property
    def is_ready(self) -> bool:
        return not self.missing_components

    def check_model(self, model: str | None) -> None:
        """A request naming another model than the served one is a 404 (None: any)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model_not_found", "model")

    def check_ready(self) -> None:
        if not self.is_ready:
            raise APIError(503, "The server is not ready yet (waiting for: "
                           f"{', '.join(self.missing_components)}).", "service_unavailable")

    def _scheduler_limit(self, name: str) -> int | None:
        value = getattr(self.ready.get("scheduler"), name, 0)
        return value or getattr(self.args, name)

    @property
    def context_length(self) -> int | None:
        return self._scheduler_limit("context_length")

    @property
    def embedding_dimensions(self) -> int:
        """The size of the served model's embeddings; 0 for a generation model (or while the
        scheduler has not reported)."""
        return getattr(self.ready.get("scheduler"), "embedding_dimensions", 0)

    def check_generates(self) -> None:
        """An embedding model's server refuses generation requests."""
        if self.embedding_dimensions:
            raise bad_request(f"The model `{self.model_name}` is an embedding model: it "
                              "computes embeddings (/v1/embeddings), not completions.", "model")

    def limits(self) -> dict[str, int | None]:
        return {name: self._scheduler_limit(name)
                for name in ("context_length", "max_total_tokens", "max_running_requests")}

    # ---- tokenization and limits ----------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(self._fitting_text(text, "prompt"))

    def _fitting_text(self, text: str, param: str) -> str:
        """`text` to tokenize, or a 400 when it is not Unicode or is too long for the context
        whatever its tokens (refused before a multi-megabyte text holds the event loop)."""
        context_length, most = self.context_length, self.max_token_chars
        if context_length and most and len(text) > context_length * most:
            raise bad_request(
                f"The input ({len(text)} characters) is longer than the model's context length "
                f"({context_length} tokens) can hold: no token of this model stands for more "
                f"than {most} characters.", param)
        return unicode_text(text, param)

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template has a place for `tools` (else: api/tool_calls.py)."""
        return "tools" in (self.tokenizer.chat_template or "")

    def tokenize_chat(self, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None = None,
                      options: dict[str, Any] | None = None) -> list[int]:
        """`options`: the template's other arguments (by default it adds the generation
        prompt)."""
        self.check_generates()
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False,
                **(options or {"add_generation_prompt": True}))
        except (TemplateError, ValueError, TypeError) as exc:
            raise bad_request(f"Cannot apply the chat template: {exc}", "messages") from exc
        return self.tokenizer.encode(self._fitting_text(text, "messages"),
                                     add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_texts(self, ids: list[int]) -> list[str]:
        """The text of each token on its own (cached), as logprobs report tokens."""
        missing = sorted(set(ids) - self._token_texts.keys())
        if missing:
            texts = self.tokenizer.batch_decode([[i] for i in missing])
            self._token_texts.update(zip(missing, texts))
        return [self._token_texts[i] for i in ids]

    def check_token_ids(self, ids: list[int], param: str, allow_empty: bool = False) -> None:
        if not ids and not allow_empty:
            raise bad_request("The prompt is empty.", param)
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} is out of the vocabulary [0, {self.vocab_size}).",
                              param)

    def check_disaggregation(self, bootstrap: BootstrapInfo | None,
                             samplings: list[SamplingParams]) -> None:
        """A prefill or decode server serves the requests `shoal router` paired (docs/pd.md),
        without structured outputs."""
        mode = self.args.disaggregation_mode
        if mode == "null":
            return
        if bootstrap is None:
            other = "decode" if mode == "prefill" else "prefill"
            raise bad_request(
                f"This is a {mode} server (--disaggregation-mode {mode}): send requests through "
                f"`shoal router`, which pairs it with a {other} server (bootstrap_host, "
                f"bootstrap_port and bootstrap_room are missing).", "bootstrap_room")
        if any(s.is_constrained for s in samplings):
            raise bad_request(
                "Structured outputs (response_format, json_schema, regex, ebnf, and tools with "
                "tool_choice 'required' or a named function) are not served with prefill/decode "
                "disaggregation; send them to a colocated server.", "response_format")

    def max_new_tokens(self, prompt_len: int, requested: int | None, default: int | None) -> int:
        # NOTE: one request must fit both the context window and the whole KV cache.
        limits = [v for v in (self.context_length, self._scheduler_limit("max_total_tokens")) if v]
        return fit_max_new_tokens(prompt_len, requested, default, min(limits, default=None))

    # ---- requests -------------------------------------------------------------------------------

    def generate(self, input_ids: list[int], sampling: SamplingParams, *, rid: str | None = None,
                 stream: bool = False, logprob: LogprobParams | None = None,
                 is_disconnected: IsDisconnected | None = None,
                 bootstrap: BootstrapInfo | None = None) -> AsyncIterator[ReqStrOut]:
        """Submit a request now and return an iterator over its chunks (the last has `finish`).

        Raises `APIError` at once when the server is not ready or `rid` is in use. The iterator
        ends early, aborting the request, when `is_disconnected` turns true; closing or cancelling
        it before the last chunk aborts the request too.
        """
        self.start()
        self.check_ready()
        self.check_generates()
        rid = rid or uuid.uuid4().hex
        if rid in self.rid_to_state:
            raise bad_request(f"Request id {rid!r} is already in use.", "rid")
        # NOTE: sent before it is registered: a request its encoder refuses (text that is not
        # Unicode) must not stay in `rid_to_state`; no output can arrive in between
        self._send(GenerateReq(rid=rid, input_ids=input_ids, sampling=sampling, stream=stream,
                               logprob=logprob, bootstrap=bootstrap))
        state = self.rid_to_state[rid] = ReqState()
        return self._outputs(rid, state, is_disconnected)

    async def _outputs(self, rid: str, state: ReqState,
                       is_disconnected: IsDisconnected | None) -> AsyncIterator[ReqStrOut]:
        watcher = (None if is_disconnected is None
                   else asyncio.create_task(self._watch(state, is_disconnected)))
        try:
            while (out := await state.queue.get()) is not None:
                yield out
                if out.finish is not None:
                    return
            logger.info("client disconnected, aborting request %s", rid)
        except (GeneratorExit, asyncio.CancelledError):
            if not state.finished:
                logger.info("request %s closed before its last chunk, aborting it", rid)
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
            if not state.finished:
                self.abort(rid)

    async def _watch(self, state: ReqState, is_disconnected: IsDisconnected) -> None:
        """Put None in the request's queue once its client is gone, checked every
        `disconnect_poll_s` while it runs (one task a request: a timeout on each chunk's wait
        was a task and a timer a token)."""
        while not await is_disconnected():
            await asyncio.sleep(self.disconnect_poll_s)
        state.queue.put_nowait(None)

    async def generate_full(self, input_ids: list[int], sampling: SamplingParams, *,
                            rid: str | None = None, logprob: LogprobParams | None = None,
                            is_disconnected: IsDisconnected | None = None,
                            bootstrap: BootstrapInfo | None = None) -> GenerateResult:
        """Run a request to the end; an aborted request raises its `abort_error`."""
        start = time.monotonic()
        so_far = Accumulated.expecting(logprobs=logprob is not None)
        last: ReqStrOut | None = None
        async for last in self.generate(input_ids, sampling, rid=rid, logprob=logprob,
                                         is_disconnected=is_disconnected, bootstrap=bootstrap):
            so_far.add(last)
        if last is None or last.finish is None:
            raise APIError(499, "Client closed the request.", "client_disconnected")
        if last.finish.kind == "abort":
            raise abort_error(last.finish)
        return GenerateResult(rid=last.rid, text=so_far.text, output_ids=so_far.output_ids,
                              finish=last.finish, prompt_tokens=last.prompt_tokens,
                              completion_tokens=last.completion_tokens,
                              cached_tokens=last.cached_tokens,
                              e2e_latency=time.monotonic() - start, logprobs=so_far.logprobs,
                              prompt_logprobs=so_far.prompt_logprobs)

    def abort(self, rid: str, message: str = "Aborted by request.") -> None:
        """Drop a request: tell the scheduler, and end its iterator with an `abort` chunk."""
        state = self.rid_to_state.pop(rid, None)
        self._send(AbortReq(rid=rid))
        if state is not None and not state.finished:
            state.finished = True
            state.queue.put_nowait(ReqStrOut(
                rid=rid, text="", new_ids=[], finish=FinishReason(kind="abort", message=message),
                prompt_tokens=0, completion_tokens=0, cached_tokens=0))

    def abort_all(self) -> None:
        for rid in list(self.rid_to_state):
            self.abort(rid)

    async def health_generate(self, timeout_s: float = HEALTH_CHECK_TIMEOUT_S) -> bool:
        """True when a one-token generation (an embedding model: a one-token embedding)
        finishes within the timeout (or, under load, when outputs keep arriving)."""
        if not self.is_ready:
            return False
        busy = self.rid_to_state or self.embeddings.num_pending
        if busy and time.monotonic() - self.last_receive_time < timeout_s:
            return True
        sampling = SamplingParams(max_new_tokens=1, temperature=0.0)
        try:
            async with asyncio.timeout(timeout_s):
                if self.embedding_dimensions:
                    await self.embeddings.embed([[0]])
                else:
                    await self.generate_full([0], sampling,
                                             rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
        except (TimeoutError, APIError) as exc:
            logger.warning("health generation failed: %r", exc)
            return False
        return True

    async def control(self, message: FlushCacheReq | SchedulerInfoReq,
                      timeout_s: float = CONTROL_TIMEOUT_S) -> ControlReply:
        """Send a control request to the scheduler and wait for its reply."""
        self.check_ready()
        future: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._pending_replies[message.rid] = future
        try:
            self._send(message)
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise APIError(503, "The scheduler did not answer in time.",
                           "service_unavailable") from None
        finally:
            self._pending_replies.pop(message.rid, None)

    # ---- ZMQ ------------------------------------------------------------------------------------

    def _send(self, message: Message) -> None:
        # NOTE: PUSH with SNDHWM=0 queues without blocking, so a plain socket is safe here.
        sockets.send(self._send_sock, message)

    def _drain(self) -> None:
        """Handle every message the api socket holds. ZMQ's descriptor signals a change, not a
        level: it is quiet again once the socket's events, read, show nothing to receive."""
        while self._recv_sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            data = self._recv_sock.recv(zmq.NOBLOCK)
            try:
                message = decode(data)
            except msgspec.DecodeError:
                logger.exception("dropping an undecodable message (%d bytes)", len(data))
                continue
            self.last_receive_time = time.monotonic()
            try:
                self._dispatch(message)
            except Exception:  # one bad message must not stop the reading every request needs
                logger.exception("failed to handle %s", type(message).__name__)

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, BatchStrOut):
            for out in message.outputs:
                self._route(out)
        elif isinstance(message, ComponentReady):
            logger.info("component ready: %s", message)
            self.ready[message.component] = message
        elif isinstance(message, BatchEmbeddingOut):
            self.embeddings.route(message)
        elif isinstance(message, ControlReply):
            future = self._pending_replies.get(message.rid)
            if future is not None and not future.done():
                future.set_result(message)
        else:
            logger.warning("unexpected message on the api socket: %s", type(message).__name__)

    def _route(self, out: ReqStrOut) -> None:
        state = self.rid_to_state.get(out.rid)
        if state is None:
            return  # aborted already: late chunks are dropped
        if out.finish is not None:
            del self.rid_to_state[out.rid]
            state.finished = True
        if self.metrics is not None:
            self._observe(state, out)
        state.queue.put_nowait(out)

    def _observe(self, state: ReqState, out: ReqStrOut) -> None:
        assert self.metrics is not None
        now = time.monotonic()
        self.metrics.on_output(state.created_at, state.last_output_at, now, len(out.new_ids))
        state.last_output_at = now
        if out.finish is not None:
            self.metrics.on_finish(state.created_at, now, out.prompt_tokens,
                                   out.completion_tokens)
