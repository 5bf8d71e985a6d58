"""`--api-key`: every route but `/health*` needs `Authorization: Bearer <key>`."""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from shoal.api.errors import APIError, error_response


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware), so streaming and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and not scope["path"].startswith("/health")
                and not self._authorized(scope)):
            error = APIError(401, "Missing or invalid API key (expected `Authorization: Bearer "
                             "<key>`).", "invalid_api_key")
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)
