"""`shoal bench forward`: the bare-forward ceiling of decode.

shoal's own `ModelRunner` with no server, scheduler, tokenizer or detokenizer in the loop: B
requests each hold a KV context of L tokens, then N decode steps run at batch B (forward plus a
greedy argmax to pick the next input token). tokens/s = B * N / time of those N steps. The
forwards run on the scheduler's thread counts for one rank on this host (`shoal.engine.threads`:
on CPU every core, as the plain loop), or on `--num-threads` alone.

The context is filled with one prefill of one request whose K/V are then copied to the other
B - 1 requests' slots: every request reads a context of L tokens, as in serving, without paying
B prefills (attention cost depends on the context length, not on its contents).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal import model_store
from shoal.config import ServerArgs
from shoal.engine.model_runner import ModelRunner, resolve_device, resolve_dtype
from shoal.engine.threads import RankThreads
from shoal.models.forward_batch import ForwardBatch
from shoal.models.parallel import ParallelGroup


@dataclass(frozen=True)
class ForwardBenchConfig:
    model_path: str
    batch_size: int = 32
    context_len: int = 256
    steps: int = 32
    warmup_steps: int = 2
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "none"
    num_threads: int | None = None  # every forward's; None: the scheduler's for one rank here
    seed: int = 0


@dataclass(frozen=True)
class ForwardBenchResult:
    batch_size: int
    context_len: int
    steps: int
    num_threads: int  # of the timed decode steps
    device: str
    dtype: str
    total_s: float
    tokens_per_s: float
    mean_step_ms: float
    p50_step_ms: float
    max_step_ms: float


def run_forward_bench(cfg: ForwardBenchConfig) -> ForwardBenchResult:
    device = resolve_device(cfg.device)
    threads = (RankThreads(cfg.num_threads, cfg.num_threads) if cfg.num_threads
               else RankThreads.for_host(os.cpu_count() or 1, 1, spare_core=ServerArgs()
                                         .use_overlap_schedule(device.type)))
    torch.set_num_threads(threads.base)
    torch.manual_seed(cfg.seed)
    dtype = resolve_dtype(cfg.dtype, device)
    max_len = cfg.context_len + cfg.warmup_steps + cfg.steps
    runner = ModelRunner(cfg.model_path, device, dtype, ParallelGroup(),
                         max_total_tokens=cfg.batch_size * max_len,
                         max_running_requests=cfg.batch_size, context_length=max_len,
                         threads=threads, quantization=cfg.quantization)
    rows = alloc_rows(runner, cfg.batch_size)
    prompt = torch.randint(0, runner.model_config.vocab_size, (cfg.context_len,),
                           dtype=torch.int64, device=device)
    next_ids = fill_context(runner, rows, prompt)
    seq_len = cfg.context_len
    for _ in range(cfg.warmup_steps):
        next_ids = decode_step(runner, rows, seq_len, next_ids)
        seq_len += 1
    step_s = []
    for _ in range(cfg.steps):
        start = time.perf_counter()
        next_ids = decode_step(runner, rows, seq_len, next_ids)
        step_s.append(time.perf_counter() - start)
        seq_len += 1
    total = sum(step_s)
    return ForwardBenchResult(
        batch_size=cfg.batch_size, context_len=cfg.context_len, steps=cfg.steps,
        num_threads=threads.for_tokens(cfg.batch_size), device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        total_s=total, tokens_per_s=cfg.batch_size * cfg.steps / total,
        mean_step_ms=1000 * total / cfg.steps, p50_step_ms=1000 * statistics.median(step_s),
        max_step_ms=1000 * max(step_s))


def alloc_rows(runner: ModelRunner, num_rows: int) -> list[int]:
    rows = []
    for _ in range(num_rows):
        row = runner.req_to_token_pool.alloc()
        assert row is not None, "the runner was built with too few request rows"
        rows.append(row)
    return rows


def fill_context(runner: ModelRunner, rows: list[int], prompt: torch.Tensor) -> torch.Tensor:
    """Prefill `prompt` for rows[0], copy its K/V into every other row's own slots, and return
    each row's next input token [batch] (greedy)."""
    device = runner.device
    context_len = int(prompt.shape[0])
    slots = runner.token_allocator.alloc(context_len)
    assert slots is not None
    runner.req_to_token_pool.table[rows[0], :context_len] = slots
    logits = runner.forward(ForwardBatch(
        input_ids=prompt, positions=torch.arange(context_len, device=device), out_cache_loc=slots,
        req_pool_indices=torch.tensor([rows[0]], device=device),
        seq_lens=torch.tensor([context_len], device=device), extend_lens=[context_len]))
    for row in rows[1:]:
        copy = runner.token_allocator.alloc(context_len)
        assert copy is not None
        runner.req_to_token_pool.table[row, :context_len] = copy
        for k, v in zip(runner.kv_pool.k, runner.kv_pool.v):
            k[copy] = k[slots]
            v[copy] = v[slots]
    assert isinstance(logits, torch.Tensor)
    return logits.argmax(dim=-1).expand(len(rows)).contiguous()


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
        seq_lens=torch.full((batch,), seq_len + 1, device=device), extend_lens=[1] * batch))
    assert isinstance(logits, torch.Tensor)
    return logits.argmax(dim=-1)


# -- command line ---------------------------------------------------------------------------


def forward_main(ns: argparse.Namespace) -> int:
    for name in ("batch_size", "context_len", "steps"):
        if getattr(ns, name) < 1:
            print(f"shoal bench forward: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    cfg = ForwardBenchConfig(
        model_path=ns.model_path or str(model_store.prepare()), batch_size=ns.batch_size,
        context_len=ns.context_len, steps=ns.steps, warmup_steps=ns.warmup_steps,
        device=ns.device, dtype=ns.dtype, quantization=ns.quantization,
        num_threads=ns.num_threads, seed=ns.seed)
    result = run_forward_bench(cfg)
    print(f"bare forward: batch {result.batch_size}, context {result.context_len}, "
          f"{result.steps} steps, {result.num_threads} threads, {result.device} {result.dtype}\n"
          f"  {result.tokens_per_s:.1f} tokens/s   step mean {result.mean_step_ms:.1f} ms, "
          f"p50 {result.p50_step_ms:.1f} ms, max {result.max_step_ms:.1f} ms")
    if ns.output_file:
        payload = {"config": dataclasses.asdict(cfg), "result": dataclasses.asdict(result)}
        Path(ns.output_file).write_text(json.dumps(payload, indent=2) + "\n")
    return 0
