"""Background load for failure tests: keeps a batch running until told to stop."""

from __future__ import annotations

import threading

import httpx

from tests.support.server import RunningServer

MAX_REQUESTS = 1000


def keep_busy(base_url: str, stop: threading.Event) -> None:
    """Short requests one after another until `stop` (errors are expected once the server goes)."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for i in range(MAX_REQUESTS):
            if stop.is_set():
                return
            try:
                client.post("/generate", json={"text": f"Count to {i}:", "sampling_params": {
                    "max_new_tokens": 8, "temperature": 0}})
            except httpx.HTTPError:
                return


def exit_code_under_load(server: RunningServer, timeout: float) -> int:
    """Keep `server` busy until it exits on its own (at most `timeout` seconds); its exit code."""
    stop = threading.Event()
    load = threading.Thread(target=keep_busy, args=(server.base_url, stop))
    load.start()
    try:
        return server.proc.wait(timeout=timeout)
    finally:
        stop.set()
        server.stop()
        load.join()
