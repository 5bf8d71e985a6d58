"""`shoal bench serving` against a fake OpenAI-compatible server with known timings.

The fake streams `max_tokens` text chunks: the first after TTFT_S, the others ITL_S apart, then
a finish chunk and a usage chunk with PROMPT_TOKENS / `max_tokens`. The benchmark runs through
`shoal`'s real command line in this process (the fake serves from a uvicorn thread).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from shoal import model_store
from shoal.bench.datasets import (
    REPEAT_CUE,
    REPEAT_INSTRUCTION,
    PromptMaker,
    load_tokenizer,
    random_prompts,
    repeat_prompts,
    shared_prefix_prompts,
)
from shoal.bench.serving import poisson_gaps
from shoal.cli import main
from shoal.ports import free_port
from tests.support.fake_engine import ServerThread

TTFT_S = 0.2
ITL_S = 0.05
PROMPT_TOKENS = 123
MODEL = "fake-model"


@dataclass
class FakeOpenAI:
    """Request n (1-based, the warmup is 1) fails with HTTP 500 when n is in `fail`, and breaks
    off with an error chunk after two tokens when n is in `break_off`. `reject` lists fields
    answered with 422, as `transformers serve` answers fields it does not know."""

    ttft_s: float = TTFT_S
    itl_s: float = ITL_S
    fail: set[int] = field(default_factory=set)
    break_off: set[int] = field(default_factory=set)
    reject: set[str] = field(default_factory=set)
    send_done: bool = True
    bodies: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/models", self.models),
                                 Route("/v1/completions", self.completions, methods=["POST"])])

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completions(self, request: Request) -> JSONResponse | StreamingResponse:
        self.arrivals.append(time.perf_counter())
        body = await request.json()
        self.bodies.append(body)
        n = len(self.bodies)
        if set(body) & self.reject:
            return JSONResponse({"detail": f"Unexpected fields: {set(body) & self.reject}"},
                                status_code=422)
        if n in self.fail:
            return JSONResponse({"error": {"message": "boom", "type": "server_error",
                                           "code": 500}}, status_code=500)
        return StreamingResponse(self._stream(n, body["max_tokens"]),
                                 media_type="text/event-stream")

    async def _stream(self, n: int, max_tokens: int):
        def sse(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        await asyncio.sleep(self.ttft_s)
        for i in range(max_tokens):
            if i:
                await asyncio.sleep(self.itl_s)
            if n in self.break_off and i == 2:
                yield sse({"error": {"message": "engine died", "code": 500}})
                return
            yield sse({"object": "text_completion", "model": MODEL,
                       "choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]})
        yield sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        yield sse({"choices": [], "usage": {"prompt_tokens": PROMPT_TOKENS,
                                            "completion_tokens": max_tokens,
                                            "total_tokens": PROMPT_TOKENS + max_tokens}})
        if self.send_done:
            yield "data: [DONE]\n\n"


def bench(url: str, tmp_path: Path, *args: str) -> tuple[int, dict[str, Any] | None]:
    out = tmp_path / "result.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serving", "--base-url", url, "--input-len", "16", "--disable-progress",
              "--output-file", str(out), *args])
    data = json.loads(out.read_text()) if out.exists() else None
    return int(exit_info.value.code or 0), data


def test_metrics_match_known_timings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 6 requests, 2 at a time, 5 tokens each: e2e = 0.2 + 4 x 0.05 = 0.4 s; 3 waves = 1.2 s.
    fake = FakeOpenAI()
    with ServerThread(fake.app()) as served:
        code, data = bench(served.url, tmp_path, "--num-prompts", "6", "--output-len", "5",
                           "--max-concurrency", "2")
    assert code == 0
    assert data is not None
    r = data["result"]
    assert (r["completed"], r["failed"], r["short_outputs"]) == (6, 0, 0)
    assert r["backend"] == "shoal" and r["model"] == MODEL
    assert r["total_input_tokens"] == 6 * PROMPT_TOKENS
    assert r["total_output_tokens"] == 6 * 5

    assert 200 <= r["ttft_ms"]["mean"] <= 300
    assert 200 <= r["ttft_ms"]["p50"] <= r["ttft_ms"]["p90"] <= r["ttft_ms"]["p99"] <= 400
    assert 45 <= r["itl_ms"]["mean"] <= 80
    assert 45 <= r["itl_ms"]["p50"] <= 80
    assert 45 <= r["tpot_ms"]["mean"] <= 80
    assert 400 <= r["e2e_latency_ms"]["mean"] <= 550

    assert 1.2 <= r["duration_s"] <= 1.7
    assert r["request_throughput"] == pytest.approx(6 / r["duration_s"])
    assert r["output_throughput"] == pytest.approx(30 / r["duration_s"])
    assert r["input_throughput"] == pytest.approx(6 * PROMPT_TOKENS / r["duration_s"])
    assert 3.5 <= r["request_throughput"] <= 5.0
    assert 1.5 <= r["concurrency"] <= 2.01

    assert data["config"]["max_concurrency"] == 2 and data["config"]["request_rate"] is None
    timed = fake.bodies[1:]  # the first is the warmup
    assert len(timed) == 6
    for body in timed:
        assert body["max_tokens"] == 5 and body["stream"] is True
        assert body["ignore_eos"] is True and body["temperature"] == 0
        assert body["stream_options"] == {"include_usage": True}
        assert body["model"] == MODEL
    report = capsys.readouterr().out
    assert "Output token throughput (tok/s):" in report and "Successful requests:" in report


def test_failures_are_counted_and_exit_nonzero(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeOpenAI(ttft_s=0.01, itl_s=0.005, fail={3}, break_off={5})
    with ServerThread(fake.app()) as served:
        code, data = bench(served.url, tmp_path, "--num-prompts", "6", "--output-len", "4",
                           "--max-concurrency", "1")
    assert code == 1
    assert data is not None
    r = data["result"]
    assert (r["num_requests"], r["completed"], r["failed"]) == (6, 4, 2)
    assert r["total_output_tokens"] == 4 * 4
    assert r["total_input_tokens"] == 4 * PROMPT_TOKENS
    assert any(e.startswith("HTTP 500") and "boom" in e for e in r["errors"])
    assert any("engine died" in e for e in r["errors"])
    err = capsys.readouterr().err
    assert "2 of 6 requests failed" in err and "boom" in err


def test_transformers_style_server_gets_generation_config(tmp_path: Path) -> None:
    # Like `transformers serve`: 422 on `ignore_eos`, no `data: [DONE]` at the end.
    fake = FakeOpenAI(ttft_s=0.01, itl_s=0.005, reject={"ignore_eos"}, send_done=False)
    with ServerThread(fake.app()) as served:
        code, data = bench(served.url, tmp_path, "--num-prompts", "3", "--output-len", "6")
    assert code == 0
    assert data is not None
    assert data["result"]["backend"] == "transformers"
    assert data["result"]["completed"] == 3 and data["result"]["total_output_tokens"] == 18
    assert "ignore_eos" in fake.bodies[0]  # the probe the server refused
    timed = fake.bodies[-3:]
    for body in timed:
        assert "ignore_eos" not in body
        assert json.loads(body["generation_config"]) == {
            "eos_token_id": -1, "do_sample": False, "max_new_tokens": 6}


def test_unknown_server_without_usage_fails(tmp_path: Path) -> None:
    fake = FakeOpenAI(ttft_s=0.01, itl_s=0.005)

    async def no_usage(n: int, max_tokens: int):
        yield 'data: {"choices": [{"index": 0, "text": " hi"}]}\n\n'
        yield "data: [DONE]\n\n"

    fake._stream = no_usage  # type: ignore[method-assign]
    with ServerThread(fake.app()) as served:
        code, data = bench(served.url, tmp_path, "--num-prompts", "2", "--output-len", "2",
                           "--warmup-requests", "0", "--backend", "shoal")
    assert code == 1
    assert data is not None
    assert data["result"]["failed"] == 2
    assert all("without a usage chunk" in e for e in data["result"]["errors"])


def test_poisson_arrivals_follow_the_seeded_gaps(tmp_path: Path) -> None:
    fake = FakeOpenAI(ttft_s=0.0, itl_s=0.0)
    rate, num = 10.0, 8
    with ServerThread(fake.app()) as served:
        code, _ = bench(served.url, tmp_path, "--num-prompts", str(num), "--output-len", "1",
                        "--request-rate", str(rate), "--seed", "7", "--warmup-requests", "0",
                        "--backend", "shoal")
    assert code == 0
    planned = poisson_gaps(num, rate, seed=7)
    measured = [b - a for a, b in zip(fake.arrivals, fake.arrivals[1:])]
    assert len(measured) == len(planned) == num - 1
    span, planned_span = fake.arrivals[-1] - fake.arrivals[0], sum(planned)
    assert planned_span - 0.05 <= span <= planned_span + 0.5
    for got, want in zip(measured, planned):
        assert got >= want - 0.05


def test_poisson_gaps_have_the_requested_rate() -> None:
    gaps = poisson_gaps(20001, 4.0, seed=1)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)
    assert poisson_gaps(5, 4.0, seed=1) == poisson_gaps(5, 4.0, seed=1)
    assert poisson_gaps(5, 4.0, seed=1) != poisson_gaps(5, 4.0, seed=2)


def test_infinite_rate_sends_everything_at_once(tmp_path: Path) -> None:
    fake = FakeOpenAI(ttft_s=0.3, itl_s=0.0)
    with ServerThread(fake.app()) as served:
        code, data = bench(served.url, tmp_path, "--num-prompts", "8", "--output-len", "1",
                           "--warmup-requests", "0", "--backend", "shoal")
    assert code == 0 and data is not None
    assert fake.arrivals[-1] - fake.arrivals[0] < 0.25  # all 8 in flight before the first TTFT
    assert data["result"]["duration_s"] < 0.6
    assert not math.isinf(data["result"]["duration_s"])


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    code, data = bench("http://127.0.0.1:9", tmp_path, "--num-prompts", "0")
    assert code == 2 and data is None


def test_unreachable_server_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = bench(f"http://127.0.0.1:{free_port()}", tmp_path, "--num-prompts", "1",
                    "--model", MODEL)
    assert code == 1
    assert "warmup request failed" in capsys.readouterr().err


@pytest.fixture(scope="module")
def maker_factory():
    tokenizer = load_tokenizer(str(model_store.prepare()))
    import random

    return lambda seed: PromptMaker(tokenizer, random.Random(seed))


def test_random_prompts_have_the_requested_token_count(maker_factory) -> None:
    maker = maker_factory(0)
    prompts = random_prompts(maker, 20, 200, 7)
    assert [maker.count(p.text) for p in prompts] == [200] * 20
    assert all(p.num_tokens == 200 and p.output_len == 7 for p in prompts)
    assert len({p.text for p in prompts}) == 20
    again = random_prompts(maker_factory(0), 20, 200, 7)
    assert [p.text for p in again] == [p.text for p in prompts]


def test_repeat_prompts_ask_to_repeat_a_text_of_the_requested_length(maker_factory) -> None:
    maker = maker_factory(1)
    prompts = repeat_prompts(maker, 5, 150, 9)
    for p in prompts:
        assert p.text.startswith(REPEAT_INSTRUCTION) and p.text.endswith(REPEAT_CUE)
        body = p.text.removeprefix(REPEAT_INSTRUCTION).removesuffix(REPEAT_CUE)
        assert maker.count(body) == 150 and p.output_len == 9
        assert p.num_tokens == maker.count(p.text) > 150
    assert len({p.text for p in prompts}) == 5


def test_shared_prefix_prompts_share_an_exact_prefix(maker_factory) -> None:
    maker = maker_factory(3)
    prompts = shared_prefix_prompts(maker, 6, 300, 12, 4)
    tokenizer = maker.tokenizer
    ids = [tokenizer.encode(p.text, add_special_tokens=False) for p in prompts]
    assert all(len(i) == 312 for i in ids)
    assert all(i[:300] == ids[0][:300] for i in ids)
    assert len({tuple(i[300:]) for i in ids}) == 6


def test_shared_prefix_run_sends_the_prefix_but_warms_up_without_it(tmp_path: Path) -> None:
    fake = FakeOpenAI(ttft_s=0.01, itl_s=0.005)
    with ServerThread(fake.app()) as served:
        code, data = bench(served.url, tmp_path, "--dataset", "shared-prefix", "--prefix-len",
                           "64", "--suffix-len", "8", "--num-prompts", "4", "--output-len", "2")
    assert code == 0 and data is not None
    warmup, timed = fake.bodies[0]["prompt"], [b["prompt"] for b in fake.bodies[1:]]
    assert len(timed) == 4 and len(set(timed)) == 4
    common = os.path.commonprefix(timed)
    assert len(common) >= 64 * 3  # 64 shared words of 2+ letters, each after a space
    assert not warmup.startswith(common[:20])
    assert fake.bodies[0]["max_tokens"] == 4
    assert data["config"]["dataset"] == "shared-prefix"
    assert data["config"]["mean_prompt_tokens_client"] == 72
