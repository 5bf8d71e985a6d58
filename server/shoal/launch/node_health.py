"""The small `/health` endpoint of a node that runs only scheduler ranks (node rank > 0)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve_node_health(host: str, port: int, is_healthy: Callable[[], bool]) -> ThreadingHTTPServer:
    """Answer GET /health with 200 while `is_healthy()`, else 503, from a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server hook name
            if self.path != "/health":
                self.send_error(404)
                return
            ok = is_healthy()
            body = b'{"status": "ok"}' if ok else b'{"status": "unhealthy"}'
            self.send_response(200 if ok else 503)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="node-health", daemon=True).start()
    return server
