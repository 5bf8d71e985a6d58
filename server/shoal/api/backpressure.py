"""`--max-queued-requests N`: a bound on the generation requests the api holds at once.

The api admits at most `--max-running-requests` + N generation requests (POST `/generate`,
`/v1/completions`, `/v1/chat/completions`, `/v1/responses`; one HTTP request counts once,
whatever its `n`): enough to keep every running slot of the scheduler busy plus a queue of N.
Beyond that a request is answered at once, before its body is read, with 429, an OpenAI error
body and `Retry-After`, and counted in `shoal:rejected_requests_total` when metrics are on.
Without the flag nothing is bounded (SGLang's default).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter
from starlette.types import ASGIApp, Receive, Scope, Send

from shoal.api.errors import APIError, error_response

GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions",
                              "/v1/responses"})
RETRY_AFTER_S = 1


def admission_limit(max_running_requests: int | None, max_queued_requests: int) -> int:
    """How many generation requests the api holds at once (running capacity unknown: the queue
    alone)."""
    return (max_running_requests or 0) + max_queued_requests


class BackpressureMiddleware:
    """Plain ASGI, so that streaming and disconnects pass through untouched; a request counts
    from its arrival until its response (a whole stream) has been sent or the client left."""

    def __init__(self, app: ASGIApp, max_queued_requests: int,
                 max_running_requests: Callable[[], int | None],
                 enable_metrics: bool = False) -> None:
        self.app = app
        self.max_queued_requests = max_queued_requests
        self.max_running_requests = max_running_requests
        self.num_in_flight = 0
        # NOTE: multiprocess metrics are read from the files every process writes, so the
        # counter needs no registry (and two apps in one test process do not collide)
        self.rejected = Counter(
            "shoal:rejected_requests", "Generation requests refused with 429 "
            "(--max-queued-requests)", registry=None) if enable_metrics else None

    @property
    def limit(self) -> int:
        return admission_limit(self.max_running_requests(), self.max_queued_requests)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] != "POST"
                or scope["path"] not in GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        if self.num_in_flight >= self.limit:
            await self._reject(scope, receive, send)
            return
        self.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_in_flight -= 1

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.rejected is not None:
            self.rejected.inc()
        response = error_response(APIError(
            429, f"The server is at capacity: {self.num_in_flight} requests are running or "
                 f"queued (--max-queued-requests {self.max_queued_requests}). Retry later.",
            "too_many_requests"))
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        await response(scope, receive, send)
