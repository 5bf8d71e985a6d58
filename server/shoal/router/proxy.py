"""Forwarding a request: to one colocated worker, or to a prefill/decode pair at once.

A pair gets the same body, plus `bootstrap_host` (the prefill's host), `bootstrap_port` (its
/server_info) and a fresh random `bootstrap_room` (SGLang's protocol). The decode's response is
the client's (it carries the whole output: the prefill's first token travels with the KV); the
prefill's is read to its end in the background. Whichever answers with an error first speaks:
a prefill's 400 (a prompt too long) reaches the client and the decode's request is closed.

Until the first byte of the response reaches the client, a worker that cannot be reached or
answers 5xx is replaced by another (`--max-retries`; a pair: the side that failed, with a new
room) — for a streamed response that is until its first chunk. Afterwards a failure ends the
stream with an error event. A client that goes away closes the upstream requests, and each
server aborts its request (freeing its KV on both sides of a pair).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from shoal.api.errors import APIError, error_body, error_response
from shoal.router.args import RouterArgs
from shoal.router.metrics import RouterMetrics
from shoal.router.policies import CacheAwareConfig, Policy, make_policy
from shoal.router.workers import COLOCATED, DECODE, PREFILL, Worker, WorkerPool

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5
FORWARDED_HEADERS = ("authorization",)
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response started."""


class UpstreamFailed(Exception):
    """A worker could not give a response worth returning; another may be tried."""

    def __init__(self, worker: Worker, message: str, response: Response | None = None) -> None:
        super().__init__(message)
        self.worker = worker
        self.message = message
        self.response = response  # a 5xx to return as it is when no other worker is left


@dataclass
class Upstream:
    """An open response of a worker, its first body chunk read."""

    worker: Worker
    response: httpx.Response
    first: bytes
    chunks: AsyncIterator[bytes]
    closed: bool = field(default=False)
    partner: asyncio.Task[None] | None = None  # a decode's: its prefill's response, draining

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.worker.inflight -= 1
            await self.response.aclose()

    async def abandon(self) -> None:
        """Close it unfinished (the client went away): the pair's prefill request goes too."""
        if self.partner is not None:
            self.partner.cancel()
        await self.close()

    async def read_rest(self) -> bytes:
        try:
            return self.first + b"".join([chunk async for chunk in self.chunks])
        finally:
            await self.close()

    def as_response(self, body: bytes) -> Response:
        return Response(body, status_code=self.response.status_code,
                        media_type=self.response.headers.get("content-type"))


def prompt_text(body: dict[str, Any]) -> str:
    """The text cache_aware matches on: the chat messages (a response's input messages), the
    prompt, or /generate's input."""
    messages = body.get("messages", body.get("input"))
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if isinstance(message, dict):
                content = message.get("content")
                if isinstance(content, list):
                    content = "".join(str(p.get("text", "")) for p in content
                                      if isinstance(p, dict))
                parts.append(f"{message.get('role')}: {content}\n")
        return "".join(parts)
    for key in ("prompt", "text", "input_ids", "input"):
        value = body.get(key)
        if value is not None:
            return value if isinstance(value, str) else json.dumps(value)
    return ""


def bootstrap_fields(prefill: Worker) -> dict[str, Any]:
    return {"bootstrap_host": prefill.host, "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": secrets.randbits(63)}


class Proxy:
    def __init__(self, args: RouterArgs, pool: WorkerPool, client: httpx.AsyncClient,
                 metrics: RouterMetrics) -> None:
        self.args = args
        self.pool = pool
        self.client = client
        self.metrics = metrics
        config = CacheAwareConfig(args.cache_threshold, args.balance_abs_threshold,
                                  args.balance_rel_threshold, args.max_tree_size)
        self.policies: dict[str, Policy] = {role: make_policy(args.policy, config)
                                            for role in (COLOCATED, PREFILL, DECODE)}
        self._background: set[asyncio.Task[None]] = set()

    async def generate(self, request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error_response(APIError(400, "Invalid JSON body.", "invalid_request"))
        if not isinstance(body, dict):
            return error_response(APIError(400, "The body must be a JSON object.",
                                           "invalid_request"))
        text = prompt_text(body)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        tried: set[str] = set()
        failure: UpstreamFailed | None = None
        for attempt in range(self.args.max_retries + 1):
            if attempt:
                self.metrics.retries.inc()
            try:
                return await self._attempt(request, path, body, headers, text, tried)
            except UpstreamFailed as exc:
                logger.warning("%s via %s failed (attempt %d): %s", path, exc.worker.url,
                               attempt + 1, exc.message)
                tried.add(exc.worker.url)
                failure = exc
            except ClientGone:
                return Response(status_code=499)
            except LookupError:
                break
        if failure is not None and failure.response is not None:
            return failure.response
        message = failure.message if failure is not None else "no healthy worker can serve it"
        return error_response(APIError(503, f"The request could not be routed: {message}.",
                                       "service_unavailable"))

    async def get(self, path: str, headers: dict[str, str]) -> Response:
        """A GET answered by any one usable worker (the model list)."""
        for worker in self.pool.candidates(DECODE) + self.pool.candidates(COLOCATED):
            try:
                response = await self.client.get(worker.url + path, headers=headers)
            except httpx.TransportError as exc:
                self.pool.mark_failed(worker, repr(exc))
                continue
            return Response(response.content, status_code=response.status_code,
                            media_type=response.headers.get("content-type"))
        return error_response(APIError(503, "No healthy worker.", "service_unavailable"))

    # -- one attempt ------------------------------------------------------------------------

    async def _attempt(self, request: Request, path: str, body: dict[str, Any],
                       headers: dict[str, str], text: str, tried: set[str]) -> Response:
        colocated = self.pool.candidates(COLOCATED, tried)
        if colocated:
            worker = self._choose(COLOCATED, colocated, text)
            upstream = await self._watch(request, self._open(worker, path, body, headers))
            return await self._respond(request, upstream)
        prefills = self.pool.pairable_prefills(tried)
        if not prefills:
            raise LookupError("no usable worker left")
        prefill = self._choose(PREFILL, prefills, text)
        decode = self._choose(DECODE, self.pool.decodes_for(prefill, tried), text)
        pair_body = {**body, **bootstrap_fields(prefill)}
        upstream = await self._watch(request, self._open_pair(prefill, decode, path, pair_body,
                                                              headers))
        return await self._respond(request, upstream)

    def _choose(self, role: str, candidates: list[Worker], text: str) -> Worker:
        chosen = self.policies[role].choose(candidates, text)
        assert isinstance(chosen, Worker)
        self.metrics.requests.labels(chosen.url, role).inc()
        return chosen

    async def _open(self, worker: Worker, path: str, body: dict[str, Any],
                    headers: dict[str, str]) -> Upstream:
        """POST to the worker; its response open, the first chunk read. A 5xx or a failed
        connection raises `UpstreamFailed`."""
        worker.inflight += 1
        request = self.client.build_request("POST", worker.url + path, json=body,
                                            headers=headers)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            worker.inflight -= 1
            self.pool.mark_failed(worker, repr(exc))
            raise UpstreamFailed(worker, f"cannot reach {worker.url}: {exc!r}") from exc
        chunks = response.aiter_raw()
        upstream = Upstream(worker, response, b"", chunks)
        try:
            upstream.first = await anext(chunks, b"")
            if response.status_code >= 500:
                content = await upstream.read_rest()
                raise UpstreamFailed(worker, f"{worker.url} answered {response.status_code}: "
                                     f"{content[:300].decode(errors='replace')}",
                                     upstream.as_response(content))
        except httpx.TransportError as exc:
            await upstream.close()
            self.pool.mark_failed(worker, repr(exc))
            raise UpstreamFailed(worker, f"{worker.url} failed: {exc!r}") from exc
        except BaseException:
            await upstream.close()
            raise
        return upstream

    async def _open_pair(self, prefill: Worker, decode: Worker, path: str,
                         body: dict[str, Any], headers: dict[str, str]) -> Upstream:
        """Both requests at once; the decode's upstream, once it has started (or the error that
        came first). The prefill's response is then read to its end in the background."""
        p_open = asyncio.create_task(self._open(prefill, path, body, headers))
        d_open = asyncio.create_task(self._open(decode, path, body, headers))
        try:
            done, _ = await asyncio.wait({p_open, d_open}, return_when=asyncio.FIRST_COMPLETED)
            if p_open in done and (p_open.exception() is not None
                                   or p_open.result().response.status_code >= 400):
                await _discard(d_open)
                upstream = p_open.result()  # raises the prefill's failure
                return upstream  # its 4xx: the client's problem, the decode's request closed
            decoded = await d_open
        except BaseException:
            await _discard(p_open)
            await _discard(d_open)
            raise
        if decoded.response.status_code >= 400:
            await _discard(p_open)
            return decoded
        decoded.partner = self._in_background(self._drain(p_open))
        return decoded

    async def _drain(self, opening: asyncio.Task[Upstream]) -> None:
        """Read a prefill's response to its end (it ends when the decode has the KV); cancelled,
        it closes the request (the prefill aborts it)."""
        try:
            upstream = await opening
            content = await upstream.read_rest()
            if upstream.response.status_code >= 400:
                logger.warning("prefill %s answered %d: %s", upstream.worker.url,
                               upstream.response.status_code, content[:300])
        except UpstreamFailed as exc:
            logger.warning("prefill failed: %s", exc.message)
        except httpx.HTTPError as exc:
            logger.warning("prefill response failed: %r", exc)
        except asyncio.CancelledError:
            await _discard(opening)
            raise

    async def _respond(self, request: Request, upstream: Upstream) -> Response:
        """The client's response: streamed as it comes (headers and the first chunk are in),
        or read to its end first (a failure before that is retried)."""
        media_type = upstream.response.headers.get("content-type", "")
        if not media_type.startswith("text/event-stream"):
            try:
                content = await self._watch(request, upstream.read_rest())
            except httpx.TransportError as exc:
                await upstream.abandon()
                self.pool.mark_failed(upstream.worker, repr(exc))
                raise UpstreamFailed(upstream.worker, f"{upstream.worker.url} failed: "
                                     f"{exc!r}") from exc
            except BaseException:
                await upstream.abandon()
                raise
            return upstream.as_response(content)
        return StreamingResponse(self._stream(upstream), status_code=upstream.response.status_code,
                                 media_type=media_type,
                                 headers={"Cache-Control": "no-cache"})

    async def _stream(self, upstream: Upstream) -> AsyncIterator[bytes]:
        finished = False
        try:
            yield upstream.first
            async for chunk in upstream.chunks:
                yield chunk
            finished = True
        except httpx.TransportError as exc:
            self.pool.mark_failed(upstream.worker, repr(exc))
            error = error_body(502, f"The worker {upstream.worker.url} failed mid-response: "
                                    f"{exc!r}", "upstream_failed")
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await (upstream.close() if finished else upstream.abandon())

    async def _watch(self, request: Request, work: Awaitable[T]) -> T:
        """`work`, unless the client disconnects first (then it is cancelled: ClientGone)."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                await _discard(task)
                raise ClientGone

    def _in_background(self, work: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)


async def _discard(task: asyncio.Future[Upstream]) -> None:
    """Cancel an upstream being opened, or close it when it already is."""
    if not task.done():
        task.cancel()
    with contextlib.suppress(BaseException):
        upstream = await task
        await upstream.close()
