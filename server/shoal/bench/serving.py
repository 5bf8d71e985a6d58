"""`shoal bench serving`: an async benchmark client for any OpenAI-compatible server.

Every request is a streaming `/v1/completions` call, greedy, with `max_tokens = --output-len`,
`stream_options.include_usage`, and whatever the server needs to ignore EOS so that every output
has the same length. Token counts come from the server's `usage`, never from the client.

Fixed-length outputs per `--backend`:
    shoal         `"ignore_eos": true` (the SGLang / vLLM extension)
    transformers  `"generation_config": "{\"eos_token_id\": -1, ...}"` (`transformers serve`
                  answers 422 to unknown fields such as `ignore_eos`; -1 disables EOS)
    openai        nothing: outputs may stop early at EOS (counted as short outputs)
    auto          the first of these that a warmup request is accepted with

Metrics (times in ms): TTFT = first chunk carrying text; ITL = gaps between consecutive chunks
carrying text, pooled over requests; TPOT = (e2e - TTFT) / (completion_tokens - 1), per request
with more than one token; e2e = request sent to stream closed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from shoal.bench.cli_args import WARMUP_OUTPUT_LEN
from shoal.bench.datasets import (
    Prompt,
    PromptMaker,
    load_tokenizer,
    random_prompts,
    repeat_prompts,
    shared_prefix_prompts,
)
from shoal.bench.tenants import tenant_prompts

PERCENTILES = (50, 90, 99)
MAX_REPORTED_ERRORS = 20
READ_BUFFER_BYTES = 1 << 20  # the longest SSE line read whole
CLIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError)


@dataclass(frozen=True)
class ServingConfig:
    base_url: str
    model: str | None = None
    tokenizer: str | None = None
    backend: str = "auto"
    dataset: str = "random"
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    prefix_len: int = 1024
    suffix_len: int = 32
    num_tenants: int = 8
    max_concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 0
    warmup_requests: int = 1
    request_timeout_s: float = 1800.0
    extra_request_body: dict[str, Any] = field(default_factory=dict)
    show_progress: bool = True


@dataclass
class RequestOutput:
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, served from the prefix cache (usage)


# -- one request ----------------------------------------------------------------------------


def request_body(model: str, prompt: Prompt, backend: str,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "prompt": prompt.text, "max_tokens": prompt.output_len,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if backend == "shoal":
        body["ignore_eos"] = True
    elif backend == "transformers":
        body["generation_config"] = json.dumps(
            {"eos_token_id": -1, "do_sample": False, "max_new_tokens": prompt.output_len})
    body.update(extra or {})
    return body


async def send_request(client: aiohttp.ClientSession, url: str,
                       body: dict[str, Any]) -> RequestOutput:
    out = RequestOutput()
    start = time.perf_counter()
    last: float | None = None
    usage: dict[str, Any] | None = None
    try:
        async with client.post(url, json=body) as resp:
            if resp.status != 200:
                detail = (await resp.read()).decode(errors="replace")[:500]
                out.error = f"HTTP {resp.status}: {detail}"
                return out
            async for raw in resp.content:
                if not raw.startswith(b"data:"):
                    continue
                now = time.perf_counter()
                data = raw[len(b"data:"):].decode().strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"error in stream: {json.dumps(chunk['error'])[:500]}"
                    return out
                if any(c.get("text") for c in chunk.get("choices") or []):
                    if last is None:
                        out.ttft_s = now - start
                    else:
                        out.itl_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except CLIENT_ERRORS as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.e2e_s = time.perf_counter() - start
    if usage is None:
        out.error = "the stream ended without a usage chunk"
    elif last is None:
        out.error = "the stream carried no text"
    else:
        out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        out.completion_tokens = int(usage.get("completion_tokens") or 0)
        out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                                or 0)
        out.ok = True
    return out


# -- the run --------------------------------------------------------------------------------


async def arrivals(prompts: list[Prompt], request_rate: float,
                   rng: random.Random) -> AsyncIterator[Prompt]:
    """Yield prompts at Poisson arrival times (`request_rate` per second), or all at once."""
    for i, prompt in enumerate(prompts):
        yield prompt
        if math.isfinite(request_rate) and i + 1 < len(prompts):
            await asyncio.sleep(rng.expovariate(request_rate))


def poisson_gaps(num_prompts: int, request_rate: float, seed: int) -> list[float]:
    """The sleeps `arrivals` makes for this seed (what a run's arrival times are built from)."""
    rng = random.Random(seed)
    return [rng.expovariate(request_rate) for _ in range(max(0, num_prompts - 1))]


class Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.done = self.failed = 0
        self.start = time.perf_counter()
        self._tty = sys.stderr.isatty()
        self._next_line = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        line = (f"[bench] {self.done}/{self.total} requests, {self.failed} failed, "
                f"{elapsed:.1f} s")
        if self._tty:
            end = "\n" if self.done == self.total else ""
            print("\r" + line, end=end, file=sys.stderr, flush=True)
        elif self.done == self.total or elapsed >= self._next_line:
            print(line, file=sys.stderr, flush=True)
            self._next_line = elapsed + 10.0


async def resolve_model(client: aiohttp.ClientSession, base_url: str) -> str:
    async with client.get(f"{base_url}/v1/models") as resp:
        resp.raise_for_status()
        models = (await resp.json()).get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])


async def warm_up(client: aiohttp.ClientSession, url: str, model: str, prompt: Prompt,
                  cfg: ServingConfig) -> tuple[str, list[str]]:
    """Send the warmup requests; with `--backend auto`, pick the first style the server
    accepts. Returns the backend and the errors of the styles it refused."""
    candidates = ["shoal", "transformers", "openai"] if cfg.backend == "auto" else [cfg.backend]
    short = dataclasses.replace(prompt, output_len=WARMUP_OUTPUT_LEN)
    errors = []
    for backend in candidates:
        out = await send_request(client, url, request_body(model, short, backend,
                                                           cfg.extra_request_body))
        if out.ok:
            for _ in range(cfg.warmup_requests - 1):
                await send_request(client, url, request_body(model, short, backend,
                                                             cfg.extra_request_body))
            return backend, errors
        errors.append(f"{backend}: {out.error}")
    raise RuntimeError("warmup request failed: " + "; ".join(errors))


async def run_benchmark(cfg: ServingConfig, prompts: list[Prompt],
                        warmup: Prompt) -> dict[str, Any]:
    base_url = cfg.base_url.rstrip("/")
    url = f"{base_url}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=None, connect=30.0, sock_read=cfg.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                     read_bufsize=READ_BUFFER_BYTES) as client:
        model = cfg.model or await resolve_model(client, base_url)
        backend = cfg.backend
        if cfg.warmup_requests > 0 or backend == "auto":
            backend, _ = await warm_up(client, url, model, warmup, cfg)
        semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        progress = Progress(len(prompts), cfg.show_progress)

        async def one(prompt: Prompt) -> RequestOutput:
            body = request_body(model, prompt, backend, cfg.extra_request_body)
            if semaphore is None:
                out = await send_request(client, url, body)
            else:
                async with semaphore:
                    out = await send_request(client, url, body)
            progress.update(out.ok)
            return out

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(p))
                 async for p in arrivals(prompts, cfg.request_rate, random.Random(cfg.seed))]
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return {"model": model, "backend": backend, "duration_s": duration,
            **summarize(outputs, duration, [p.output_len for p in prompts])}


# -- metrics --------------------------------------------------------------------------------


def _stats(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = np.asarray(values_s) * 1000.0
    return {"mean": float(ms.mean()),
            **{f"p{q}": float(np.percentile(ms, q)) for q in PERCENTILES}}


def summarize(outputs: list[RequestOutput], duration_s: float,
              expected_output_lens: list[int]) -> dict[str, Any]:
    ok = [o for o in outputs if o.ok]
    input_tokens = sum(o.prompt_tokens for o in ok)
    output_tokens = sum(o.completion_tokens for o in ok)
    short = sum(o.completion_tokens < n for o, n in zip(outputs, expected_output_lens) if o.ok)
    tpot = [(o.e2e_s - o.ttft_s) / (o.completion_tokens - 1) for o in ok
            if o.completion_tokens > 1]
    errors = [o.error for o in outputs if not o.ok]
    return {
        "num_requests": len(outputs),
        "completed": len(ok),
        "failed": len(errors),
        "short_outputs": short,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cache_hit_rate": (sum(o.cached_tokens for o in ok) / input_tokens
                           if input_tokens else 0.0),
        "request_throughput": len(ok) / duration_s,
        "input_throughput": input_tokens / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "concurrency": sum(o.e2e_s for o in ok) / duration_s,
        "ttft_ms": _stats([o.ttft_s for o in ok]),
        "itl_ms": _stats([gap for o in ok for gap in o.itl_s]),
        "tpot_ms": _stats(tpot),
        "e2e_latency_ms": _stats([o.e2e_s for o in ok]),
        "errors": errors[:MAX_REPORTED_ERRORS],
    }


def format_report(result: dict[str, Any]) -> str:
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        f"{'=' * 20} Serving Benchmark Result {'=' * 20}",
        f"{'Backend:':<40}{result['backend']}",
        f"{'Model:':<40}{result['model']}",
        f"{'Successful requests:':<40}{result['completed']}",
        f"{'Failed requests:':<40}{result['failed']}",
        f"{'Benchmark duration (s):':<40}{result['duration_s']:.2f}",
        f"{'Total input tokens (usage):':<40}{result['total_input_tokens']}",
        f"{'Total output tokens (usage):':<40}{result['total_output_tokens']}",
        f"{'Prefix cache hit rate (usage):':<40}{result['cache_hit_rate']:.3f}",
        f"{'Request throughput (req/s):':<40}{result['request_throughput']:.2f}",
        f"{'Input token throughput (tok/s):':<40}{result['input_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<40}{result['output_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<40}{result['total_token_throughput']:.2f}",
        f"{'Concurrency:':<40}{result['concurrency']:.2f}",
    ]
    for key, title in (("ttft_ms", "Time to First Token"), ("itl_ms", "Inter-token Latency"),
                       ("tpot_ms", "Time per Output Token"), ("e2e_latency_ms", "E2E Latency")):
        lines.append(f"{'-' * 20} {title} (ms) {'-' * 20}")
        stats = result[key]
        lines += [f"{'Mean:':<40}{fmt(stats['mean'])}"]
        lines += [f"{f'P{q}:':<40}{fmt(stats[f'p{q}'])}" for q in PERCENTILES]
    if result["short_outputs"]:
        lines.append(f"WARNING: {result['short_outputs']} outputs were shorter than --output-len")
    return "\n".join(lines + ["=" * 66])


# -- command line ---------------------------------------------------------------------------


def config_from_namespace(ns: argparse.Namespace) -> ServingConfig:
    checks = [(ns.num_prompts >= 1, "--num-prompts must be >= 1"),
              (ns.input_len >= 1 and ns.output_len >= 1, "--input-len/--output-len must be >= 1"),
              (ns.prefix_len >= 1 and ns.suffix_len >= 1, "--prefix-len/--suffix-len must be >= 1"),
              (ns.num_tenants >= 1, "--num-tenants must be >= 1"),
              (ns.max_concurrency is None or ns.max_concurrency >= 1,
               "--max-concurrency must be >= 1"),
              (ns.request_rate > 0, "--request-rate must be > 0"),
              (ns.warmup_requests >= 0, "--warmup-requests must be >= 0")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    extra = json.loads(ns.extra_request_body) if ns.extra_request_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-request-body must be a JSON object")
    return ServingConfig(
        base_url=ns.base_url, model=ns.model, tokenizer=ns.tokenizer, backend=ns.backend,
        dataset=ns.dataset, num_prompts=ns.num_prompts, input_len=ns.input_len,
        output_len=ns.output_len, prefix_len=ns.prefix_len, suffix_len=ns.suffix_len,
        num_tenants=ns.num_tenants, max_concurrency=ns.max_concurrency,
        request_rate=ns.request_rate, seed=ns.seed,
        warmup_requests=ns.warmup_requests, request_timeout_s=ns.request_timeout,
        extra_request_body=extra, show_progress=not ns.disable_progress)


def tokenizer_path(cfg: ServingConfig) -> str:
    if cfg.tokenizer:
        return cfg.tokenizer
    if cfg.model and Path(cfg.model, "tokenizer_config.json").exists():
        return cfg.model
    from shoal import model_store

    return str(model_store.prepare())


def build_prompts(cfg: ServingConfig) -> tuple[list[Prompt], Prompt]:
    """The dataset, and a warmup prompt that shares no prefix with it (a warmup must not
    pre-fill a prefix cache with the dataset's shared prefix)."""
    maker = PromptMaker(load_tokenizer(tokenizer_path(cfg)), random.Random(cfg.seed))
    if cfg.dataset == "shared-prefix":
        prompts = shared_prefix_prompts(maker, cfg.num_prompts, cfg.prefix_len, cfg.suffix_len,
                                        cfg.output_len)
    elif cfg.dataset == "tenants":
        prompts = tenant_prompts(maker, cfg.num_prompts, cfg.num_tenants, cfg.prefix_len,
                                 cfg.suffix_len, cfg.output_len)
    elif cfg.dataset == "repeat":
        prompts = repeat_prompts(maker, cfg.num_prompts, cfg.input_len, cfg.output_len)
    else:
        prompts = random_prompts(maker, cfg.num_prompts, cfg.input_len, cfg.output_len)
    maker.rng = random.Random(f"warmup-{cfg.seed}")
    warmup = random_prompts(maker, 1, min(cfg.input_len, 64), WARMUP_OUTPUT_LEN)[0]
    return prompts, warmup


def run(cfg: ServingConfig) -> dict[str, Any]:
    """Build the dataset, run the benchmark, and return {"config", "result"}."""
    prompts, warmup = build_prompts(cfg)
    result = asyncio.run(run_benchmark(cfg, prompts, warmup))
    config = dataclasses.asdict(cfg)
    config["request_rate"] = None if math.isinf(cfg.request_rate) else cfg.request_rate
    config["mean_prompt_tokens_client"] = sum(p.num_tokens for p in prompts) / len(prompts)
    return {"config": config, "result": result}


def serving_main(ns: argparse.Namespace) -> int:
    try:
        cfg = config_from_namespace(ns)
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"shoal bench serving: {exc}", file=sys.stderr)
        return 2
    try:
        report = run(cfg)
    except (RuntimeError, KeyError, *CLIENT_ERRORS) as exc:
        print(f"shoal bench serving: {exc}", file=sys.stderr)
        return 1
    result = report["result"]
    print(format_report(result))
    if ns.output_file:
        Path(ns.output_file).write_text(json.dumps(report, indent=2) + "\n")
    if result["failed"]:
        print(f"shoal bench serving: {result['failed']} of {result['num_requests']} requests "
              f"failed:", file=sys.stderr)
        for error in result["errors"]:
            print(f"  {error}", file=sys.stderr)
        return 1
    return 0
