"""`shoal bench soak`: thousands of mixed requests against a running server, then proof that
nothing was lost.

The workload (`soak_mix.py`) runs at a fixed concurrency, with a share of the streaming clients
disconnecting mid-stream and a share aborted through `/abort_request`. Afterwards the server is
waited on until idle and the report holds: every failure of a request that was not cut, each
component's RSS after the baseline request (a fifth of the run) and at the end, each
component's open file descriptors before the run (after a warmup, whose connection may still be
open then) and after it, the KV pool
after idle and after `/flush_cache`, and what `/health_generate` answered. `SoakReport.problems`
turns those figures into the verdict (nothing lost, RSS grew at most `max_rss_growth`, no more
open fds than before, the pool wholly free).

The server's processes are found from the port: the process listening on it (the api) and every
`shoal::` process beside it under the same parent (`shoal serve` or supervisord).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil

from shoal.bench.soak_mix import (
    SoakRequest,
    StreamSummary,
    check_answer,
    check_stream,
    make_requests,
)

WARMUP_BODY = {"prompt": "Warm up", "max_tokens": 2}
FDS_SETTLE_S = 30.0


@dataclass(frozen=True)
class SoakConfig:
    base_url: str
    num_requests: int = 1000
    concurrency: int = 48
    max_tokens_cap: int = 16
    disconnect_fraction: float = 0.2
    abort_fraction: float = 0.05
    seed: int = 0
    request_timeout_s: float = 300.0
    idle_timeout_s: float = 120.0
    api_key: str | None = None

    @property
    def baseline_request(self) -> int:
        """After how many finished requests the RSS baseline is taken (200 of 1,000)."""
        return max(1, self.num_requests // 5)


@dataclass
class SoakReport:
    num_requests: int
    concurrency: int
    num_disconnected: int = 0
    num_aborted: int = 0
    failures: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    rss_baseline: dict[str, int] = field(default_factory=dict)   # component -> bytes
    rss_end: dict[str, int] = field(default_factory=dict)
    fds_start: dict[str, int] = field(default_factory=dict)      # component -> open fds
    fds_end: dict[str, int] = field(default_factory=dict)
    pool_after_idle: dict[str, int] = field(default_factory=dict)
    pool_after_flush: dict[str, int] = field(default_factory=dict)
    health_generate_status: int = 0

    def rss_growth(self) -> dict[str, float]:
        return {name: self.rss_end[name] / self.rss_baseline[name] - 1
                for name in self.rss_baseline if name in self.rss_end}

    def problems(self, max_rss_growth: float = 0.10) -> list[str]:
        """Everything that says something was lost; empty when the soak passed."""
        problems = list(self.failures)
        problems += [f"{name}: RSS grew {growth:.1%}" for name, growth in
                     self.rss_growth().items() if growth > max_rss_growth]
        problems += [f"{name}: {self.fds_end.get(name)} open fds, {count} before" for name, count
                     in self.fds_start.items() if self.fds_end.get(name, count + 1) > count]
        pool = self.pool_after_idle
        if pool.get("num_free_slots", -1) + pool.get("num_cached_slots", 0) != \
                pool.get("num_total_slots"):
            problems.append(f"KV pool after idle: {pool}")
        if self.pool_after_flush.get("num_free_slots") != pool.get("num_total_slots"):
            problems.append(f"KV pool after /flush_cache: {self.pool_after_flush}")
        if self.health_generate_status != 200:
            problems.append(f"/health_generate answered {self.health_generate_status}")
        return problems


# ---- the server's processes -----------------------------------------------------------------

def server_processes(base_url: str) -> list[psutil.Process]:
    """The `shoal::` components of the server listening at `base_url`."""
    port = urlsplit(base_url).port or 80
    listener = next((conn.pid for conn in psutil.net_connections(kind="tcp")
                     if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port
                     and conn.pid is not None), None)
    if listener is None:
        raise RuntimeError(f"no local process listens on port {port}")
    api = psutil.Process(listener)
    parent = api.parent()
    siblings = parent.children(recursive=True) if parent is not None else [api]
    return [p for p in siblings if _title(p).startswith("shoal::")]


def _title(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline()).strip()
    except psutil.Error:
        return ""


def rss_by_component(processes: list[psutil.Process]) -> dict[str, int]:
    return {_title(p): p.memory_info().rss for p in processes}


def fds_by_component(processes: list[psutil.Process]) -> dict[str, int]:
    return {_title(p): p.num_fds() for p in processes}


# ---- one request ----------------------------------------------------------------------------

async def run_request(client: httpx.AsyncClient, req: SoakRequest) -> list[str]:
    """Send one request as its client would; what is wrong with its answer (nothing is checked
    of a request the client cut but that it ends)."""
    if not req.stream:
        r = await client.post(req.path, json=req.body)
        if r.status_code != 200:
            return [f"HTTP {r.status_code}: {r.text[:300]}"]
        return check_answer(req, r.json())
    summary = StreamSummary()
    async with client.stream("POST", req.path, json=req.body) as r:
        if r.status_code != 200:
            return [f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"]
        async for line in r.aiter_lines():
            if req.cut == "disconnect" and summary.num_chunks >= req.cut_after_chunks:
                return []  # leaving the block closes the connection mid-stream
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                summary.done = True
                break
            summary.add(json.loads(data))
            if req.cut == "abort" and summary.num_chunks == 1 and summary.request_id:
                rid = summary.request_id.removeprefix(req.id_prefix)
                abort = await client.post("/abort_request", json={"rid": rid})
                if abort.status_code != 200:
                    return [f"/abort_request answered {abort.status_code}: {abort.text[:300]}"]
    if req.cut is not None:
        return [] if summary.done else ["the cut stream did not end with [DONE]"]
    return check_stream(req, summary)


# ---- the run --------------------------------------------------------------------------------

async def run_soak(config: SoakConfig, processes: list[psutil.Process],
                   progress: Callable[[int], None] | None = None) -> SoakReport:
    requests = make_requests(config.num_requests, config.seed, config.max_tokens_cap,
                             config.disconnect_fraction, config.abort_fraction)
    report = SoakReport(num_requests=len(requests), concurrency=config.concurrency,
                        num_disconnected=sum(r.cut == "disconnect" for r in requests),
                        num_aborted=sum(r.cut == "abort" for r in requests))
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency * 2)
    async with httpx.AsyncClient(base_url=config.base_url, timeout=config.request_timeout_s,
                                 headers=headers, limits=limits) as client:
        (await client.post("/v1/completions", json=WARMUP_BODY)).raise_for_status()
    report.fds_start = fds_by_component(processes)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=config.base_url, timeout=config.request_timeout_s,
                                 headers=headers, limits=limits) as client:
        pending = iter(requests)
        finished = 0

        async def worker() -> None:
            nonlocal finished
            for req in pending:
                try:
                    problems = await run_request(client, req)
                except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
                    problems = [f"{type(exc).__name__}: {exc}"]
                report.failures += [_describe(req, problem) for problem in problems]
                finished += 1
                if finished == config.baseline_request:
                    report.rss_baseline = rss_by_component(processes)
                if progress is not None:
                    progress(finished)

        await asyncio.gather(*(worker() for _ in range(config.concurrency)))
    report.duration_s = time.monotonic() - started
    report.rss_end = rss_by_component(processes)
    await _after_run(config, headers, processes, report)
    return report


async def _after_run(config: SoakConfig, headers: dict[str, str],
                     processes: list[psutil.Process], report: SoakReport) -> None:
    """Idle, then the pool, `/flush_cache`, `/health_generate` and the fds (on a fresh client
    whose connection is closed before they are counted)."""
    async with httpx.AsyncClient(base_url=config.base_url, timeout=60, headers=headers) as client:
        report.pool_after_idle = await _wait_idle(client, config.idle_timeout_s)
        flushed = await client.post("/flush_cache")
        if flushed.status_code != 200:
            report.failures.append(f"/flush_cache answered {flushed.status_code}: "
                                   f"{flushed.text[:300]}")
        report.pool_after_flush = (await client.get("/server_info")).json()["scheduler"]
        report.health_generate_status = (await client.get("/health_generate")).status_code
    deadline = time.monotonic() + FDS_SETTLE_S
    while True:
        report.fds_end = fds_by_component(processes)
        settled = all(report.fds_end.get(name, count + 1) <= count
                      for name, count in report.fds_start.items())
        if settled or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.5)


async def _wait_idle(client: httpx.AsyncClient, timeout_s: float) -> dict[str, int]:
    """The scheduler's numbers once nothing runs or waits, in the api or the scheduler."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = (await client.get("/server_info")).json()
        pool = info["scheduler"]
        if (info["num_running_requests"] == 0 and pool["num_running_reqs"] == 0
                and pool["num_waiting_reqs"] == 0) or time.monotonic() > deadline:
            return dict(pool)
        await asyncio.sleep(0.5)


def _describe(req: SoakRequest, problem: str) -> str:
    kind = "stream" if req.stream else "whole"
    return f"request {req.index} ({req.path}, {kind}, n={req.n}): {problem}"


# ---- `shoal bench soak` ---------------------------------------------------------------------

def add_soak_args(parser: argparse.ArgumentParser) -> None:
    defaults = SoakConfig(base_url="http://127.0.0.1:30000")
    parser.add_argument("--base-url", default=defaults.base_url, help="server root, without /v1")
    parser.add_argument("--num-requests", type=int, default=defaults.num_requests)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--max-tokens-cap", type=int, default=defaults.max_tokens_cap,
                        help="max_tokens of each request is drawn from [1, this]")
    parser.add_argument("--disconnect-fraction", type=float,
                        default=defaults.disconnect_fraction,
                        help="share of the streaming clients that disconnect mid-stream")
    parser.add_argument("--abort-fraction", type=float, default=defaults.abort_fraction,
                        help="share of all requests aborted through /abort_request")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--output-file", default=None, help="write the report as JSON here")


def soak_main(ns: argparse.Namespace) -> int:
    config = SoakConfig(base_url=ns.base_url, num_requests=ns.num_requests,
                        concurrency=ns.concurrency, max_tokens_cap=ns.max_tokens_cap,
                        disconnect_fraction=ns.disconnect_fraction,
                        abort_fraction=ns.abort_fraction, seed=ns.seed, api_key=ns.api_key)
    report = asyncio.run(run_soak(config, server_processes(config.base_url)))
    text = json.dumps({**dataclasses.asdict(report), "rss_growth": report.rss_growth(),
                       "problems": report.problems()}, indent=2)
    if ns.output_file:
        Path(ns.output_file).write_text(text + "\n")
    print(text)
    return 1 if report.problems() else 0
