"""`shoal bench forward`: the bare forward of a serving workload.

shoal's own `ModelRunner` with no server, scheduler, tokenizer or detokenizer in the loop, doing
the model's work of a served run of B requests with random prompts of L tokens and N output tokens
each: the B prompts prefilled in forwards of at most the scheduler's chunked-prefill budget of new
tokens (a prompt that does not fit is split, its later part extending the K/V its earlier part
wrote), which gives each request its first token, then N - 1 decode steps at batch B (forward plus
a greedy argmax to pick the next input token; the forwards read only argmaxes, as a served greedy
run's do).

    tokens/s         = B * N / time of all those forwards: what serving this workload can give
    decode tokens/s  = B * (N - 1) / time of the decode steps, with their ms a step

The forwards run on the scheduler's thread counts for one rank on this host
(`shoal.engine.threads`: on CPU every core, as the plain loop), or on `--num-threads` alone. A
warmup pass of the same workload with `--warmup-steps` decode steps runs first, on other prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal import model_store
from shoal.config import ServerArgs
from shoal.cpu_cores import usable_cores
from shoal.engine.model_runner import ModelRunner, resolve_device, resolve_dtype
from shoal.engine.threads import RankThreads
from shoal.models.forward_batch import ForwardBatch
from shoal.models.parallel import ParallelGroup
from shoal.scheduler.process import chunked_prefill_size


@dataclass(frozen=True)
class ForwardBenchConfig:
    model_path: str
    batch_size: int = 32
    input_len: int = 256
    output_len: int = 32
    prefill_tokens: int | None = None  # a prefill forward's new tokens; None: the scheduler's
    warmup_steps: int = 2
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "none"
    num_threads: int | None = None  # every forward's; None: the scheduler's for one rank here
    seed: int = 0


@dataclass(frozen=True)
class ForwardBenchResult:
    batch_size: int
    input_len: int
    output_len: int
    prefill_tokens: int
    num_threads: int  # of the decode steps
    device: str
    dtype: str
    prefill_s: float
    decode_s: float
    total_s: float
    tokens_per_s: float
    decode_tokens_per_s: float
    mean_step_ms: float
    p50_step_ms: float
    max_step_ms: float


@dataclass(frozen=True)
class Timings:
    prefill_s: float
    step_s: list[float]


def run_forward_bench(cfg: ForwardBenchConfig) -> ForwardBenchResult:
    device = resolve_device(cfg.device)
    threads = (RankThreads(cfg.num_threads, cfg.num_threads) if cfg.num_threads
               else RankThreads.for_host(usable_cores(), 1, spare_core=ServerArgs()
                                         .use_overlap_schedule(device.type)))
    torch.set_num_threads(threads.base)
    torch.manual_seed(cfg.seed)
    dtype = resolve_dtype(cfg.dtype, device)
    budget = cfg.prefill_tokens or chunked_prefill_size(ServerArgs(), device)
    max_len = cfg.input_len + max(cfg.output_len, cfg.warmup_steps + 1)
    runner = ModelRunner(cfg.model_path, device, dtype, ParallelGroup(),
                         max_total_tokens=cfg.batch_size * max_len,
                         max_running_requests=cfg.batch_size, context_length=max_len,
                         threads=threads, quantization=cfg.quantization)
    rows = alloc_rows(runner, cfg.batch_size)
    if cfg.warmup_steps:
        run_workload(runner, rows, random_prompts(runner, cfg), budget, cfg.warmup_steps + 1)
        runner.token_allocator.reset()
    timings = run_workload(runner, rows, random_prompts(runner, cfg), budget, cfg.output_len)
    decode_s = sum(timings.step_s)
    total = timings.prefill_s + decode_s
    steps = len(timings.step_s)
    return ForwardBenchResult(
        batch_size=cfg.batch_size, input_len=cfg.input_len, output_len=cfg.output_len,
        prefill_tokens=budget, num_threads=threads.for_tokens(cfg.batch_size),
        device=str(device), dtype=str(dtype).removeprefix("torch."),
        prefill_s=timings.prefill_s, decode_s=decode_s, total_s=total,
        tokens_per_s=cfg.batch_size * cfg.output_len / total,
        decode_tokens_per_s=cfg.batch_size * steps / decode_s if steps else 0.0,
        mean_step_ms=1000 * decode_s / steps if steps else 0.0,
        p50_step_ms=1000 * statistics.median(timings.step_s) if steps else 0.0,
        max_step_ms=1000 * max(timings.step_s, default=0.0))


def random_prompts(runner: ModelRunner, cfg: ForwardBenchConfig) -> list[torch.Tensor]:
    return [torch.randint(0, runner.model_config.vocab_size, (cfg.input_len,),
                          dtype=torch.int64, device=runner.device)
            for _ in range(cfg.batch_size)]


def run_workload(runner: ModelRunner, rows: list[int], prompts: list[torch.Tensor], budget: int,
                 output_len: int) -> Timings:
    """Prefill `prompts` into `rows` and decode until every row has `output_len` tokens; the
    time of the prefill forwards and of each decode step."""
    start = time.perf_counter()
    next_ids = prefill(runner, rows, prompts, budget)
    prefill_s = time.perf_counter() - start
    seq_len = int(prompts[0].shape[0])
    step_s = []
    for _ in range(output_len - 1):
        start = time.perf_counter()
        next_ids = decode_step(runner, rows, seq_len, next_ids)
        step_s.append(time.perf_counter() - start)
        seq_len += 1
    return Timings(prefill_s, step_s)


def alloc_rows(runner: ModelRunner, num_rows: int) -> list[int]:
    rows = []
    for _ in range(num_rows):
        row = runner.req_to_token_pool.alloc()
        assert row is not None, "the runner was built with too few request rows"
        rows.append(row)
    return rows


def prefill(runner: ModelRunner, rows: list[int], prompts: list[torch.Tensor],
            budget: int) -> torch.Tensor:
    """Prefill each row's prompt in forwards of at most `budget` new tokens, in order, as the
    scheduler's chunked prefill packs them; returns each row's first output token (greedy)."""
    device = runner.device
    first = torch.empty(len(rows), dtype=torch.int64, device=device)
    pending = deque((i, 0) for i in range(len(rows)))
    while pending:
        segments: list[tuple[int, int, int]] = []  # (request, start, end) of its prompt
        room = budget
        while pending and room:
            i, start = pending.popleft()
            end = min(int(prompts[i].shape[0]), start + room)
            segments.append((i, start, end))
            room -= end - start
            if end < prompts[i].shape[0]:
                pending.appendleft((i, end))
        slots = runner.token_allocator.alloc(sum(end - start for _, start, end in segments))
        assert slots is not None, "the runner was built with too few KV slots"
        offset = 0
        for i, start, end in segments:
            runner.req_to_token_pool.table[rows[i], start:end] = slots[offset:offset + end - start]
            offset += end - start
        logits = runner.forward(ForwardBatch(
            input_ids=torch.cat([prompts[i][start:end] for i, start, end in segments]),
            positions=torch.cat([torch.arange(start, end, device=device)
                                 for _, start, end in segments]),
            out_cache_loc=slots,
            req_pool_indices=torch.tensor([rows[i] for i, _, _ in segments], device=device),
            seq_lens=torch.tensor([end for _, _, end in segments], device=device),
            extend_lens=[end - start for _, start, end in segments], argmax_only=True))
        assert isinstance(logits, torch.Tensor)
        for (i, _, end), token in zip(segments, logits.argmax(dim=-1)):
            if end == prompts[i].shape[0]:
                first[i] = token
    return first


def decode_step(runner: ModelRunner, rows: list[int], seq_len: int,
                input_ids: torch.Tensor) -> torch.Tensor:
    """One decode step of every row at position `seq_len`; returns the greedy next tokens."""
    device = runner.device
    batch = len(rows)
    slots = runner.token_allocator.alloc(batch)
    assert slots is not None
    row_index = torch.tensor(rows, dtype=torch.int64, device=device)
    runner.req_to_token_pool.table[row_index, seq_len] = slots
    logits = runner.forward(ForwardBatch(
        input_ids=input_ids, positions=torch.full((batch,), seq_len, device=device),
        out_cache_loc=slots, req_pool_indices=row_index,
        seq_lens=torch.full((batch,), seq_len + 1, device=device), extend_lens=[1] * batch,
        argmax_only=True))
    assert isinstance(logits, torch.Tensor)
    return logits.argmax(dim=-1)


# -- command line ---------------------------------------------------------------------------


def forward_main(ns: argparse.Namespace) -> int:
    for name in ("batch_size", "input_len", "output_len", "prefill_tokens"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            print(f"shoal bench forward: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if ns.warmup_steps < 0:
        print("shoal bench forward: --warmup-steps must be >= 0", file=sys.stderr)
        return 2
    cfg = ForwardBenchConfig(
        model_path=ns.model_path or str(model_store.prepare()), batch_size=ns.batch_size,
        input_len=ns.input_len, output_len=ns.output_len, prefill_tokens=ns.prefill_tokens,
        warmup_steps=ns.warmup_steps, device=ns.device, dtype=ns.dtype,
        quantization=ns.quantization, num_threads=ns.num_threads, seed=ns.seed)
    result = run_forward_bench(cfg)
    print(f"bare forward: {result.batch_size} requests, {result.input_len} in / "
          f"{result.output_len} out, prefill forwards of <= {result.prefill_tokens} tokens, "
          f"{result.num_threads} threads, {result.device} {result.dtype}\n"
          f"  {result.tokens_per_s:.1f} tokens/s   (prefill {result.prefill_s:.2f} s, "
          f"decode {result.decode_s:.2f} s)\n"
          f"  decode {result.decode_tokens_per_s:.1f} tokens/s   step mean "
          f"{result.mean_step_ms:.1f} ms, p50 {result.p50_step_ms:.1f} ms, "
          f"max {result.max_step_ms:.1f} ms")
    if ns.output_file:
        payload = {"config": dataclasses.asdict(cfg), "result": dataclasses.asdict(result)}
        Path(ns.output_file).write_text(json.dumps(payload, indent=2) + "\n")
    return 0
