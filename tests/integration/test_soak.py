"""Acceptance (issue 15): a soak of mixed requests with disconnects and aborts loses nothing.

CI runs it reduced (`SOAK_REQUESTS`, 200 by default); `make soak` runs the full 1,000 at
concurrency 48 and writes the report to build/soak/soak.json (figures: docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.bench.soak import SoakConfig, SoakReport, run_soak, server_processes
from shoal.bench.soak_mix import make_requests
from tests.support.server import RunningServer, start_server

NUM_REQUESTS = int(os.environ.get("SOAK_REQUESTS", "200"))
REPORT_DIR = os.environ.get("SOAK_REPORT_DIR")
CONCURRENCY = 48


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(Path(tmp_path_factory.mktemp("soak")), "--max-total-tokens", "16384")
    yield server
    assert server.stop() == 0, server.log()


def test_the_mix_covers_every_kind_of_request() -> None:
    requests = make_requests(1000, seed=0)
    streaming = [r for r in requests if r.stream]
    disconnected = sum(r.cut == "disconnect" for r in requests)
    aborted = sum(r.cut == "abort" for r in requests)
    assert 0.15 < disconnected / len(streaming) < 0.25
    assert 0.03 < aborted / len(requests) < 0.07
    assert {r.path for r in requests} == {"/v1/chat/completions", "/v1/completions"}
    assert any(r.n > 1 for r in requests) and any(not r.stream for r in requests)
    bodies = [r.body for r in requests]
    for feature in ("stop", "frequency_penalty", "logprobs", "seed"):
        assert any(feature in body for body in bodies), feature
    assert len({body["max_tokens"] for body in bodies}) > 10


def test_soak_loses_nothing(server: RunningServer) -> None:
    processes = server_processes(server.base_url)
    assert {p.cmdline()[0] for p in processes} == set(server.component_pids())
    config = SoakConfig(base_url=server.base_url, num_requests=NUM_REQUESTS,
                        concurrency=CONCURRENCY)
    report = asyncio.run(run_soak(config, processes))
    _save(report)
    assert report.num_disconnected > 0 and report.num_aborted > 0
    assert report.problems() == [], "\n".join(report.problems()[:50])
    assert "KV pool leak" not in server.log()


def _save(report: SoakReport) -> None:
    if REPORT_DIR:
        Path(REPORT_DIR).mkdir(parents=True, exist_ok=True)
        Path(REPORT_DIR, "soak.json").write_text(json.dumps(
            {**report.__dict__, "rss_growth": report.rss_growth(),
             "problems": report.problems()}, indent=2) + "\n")
