"""`shoal bench forward` on the default model at tiny sizes."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shoal.bench.forward import alloc_rows, decode_step, fill_context
from shoal.cli import main
from shoal.engine.model_runner import ModelRunner
from shoal.engine.threads import RankThreads
from shoal.models.forward_batch import ForwardBatch
from shoal.models.parallel import ParallelGroup


@pytest.fixture(autouse=True)
def keep_torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_forward_command_reports_tokens_per_second(tmp_path: Path) -> None:
    out = tmp_path / "forward.json"
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "forward", "--batch-size", "3", "--context-len", "24", "--steps", "3",
              "--output-file", str(out)])
    assert time.monotonic() - start < 20
    assert exit_info.value.code == 0
    data = json.loads(out.read_text())
    r = data["result"]
    assert (r["batch_size"], r["context_len"], r["steps"]) == (3, 24, 3)
    assert r["num_threads"] == RankThreads.for_host(os.cpu_count() or 1, 1, spare_core=False).base
    assert (r["device"], r["dtype"]) == ("cpu", "float32")
    assert r["total_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(3 * 3 / r["total_s"])
    assert r["mean_step_ms"] == pytest.approx(1000 * r["total_s"] / 3)
    assert r["p50_step_ms"] <= r["max_step_ms"]
    assert data["config"]["model_path"]


def test_forward_rejects_empty_sizes() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "forward", "--batch-size", "0"])
    assert exit_info.value.code == 2


def test_copied_context_decodes_like_a_full_prefill(model_path: str) -> None:
    """Every row reads the K/V copied from row 0: all rows decode the same greedy tokens, and
    those are what a from-scratch prefill of prompt + generated tokens predicts."""
    torch.manual_seed(0)
    runner = ModelRunner(model_path, torch.device("cpu"), torch.float32, ParallelGroup(),
                         max_total_tokens=512, max_running_requests=4, context_length=64)
    rows = alloc_rows(runner, 3)
    prompt = torch.randint(0, runner.model_config.vocab_size, (20,), dtype=torch.int64)
    tokens = [fill_context(runner, rows, prompt)]
    for step in range(3):
        tokens.append(decode_step(runner, rows, 20 + step, tokens[-1]))
    for t in tokens:
        assert t.shape == (3,) and t.unique().numel() == 1

    generated = torch.stack([t[0] for t in tokens])
    full = torch.cat([prompt, generated[:-1]])
    (row,) = alloc_rows(runner, 1)
    slots = runner.token_allocator.alloc(len(full))
    assert slots is not None
    runner.req_to_token_pool.table[row, :len(full)] = slots
    logits = runner.forward(ForwardBatch(
        input_ids=full, positions=torch.arange(len(full)), out_cache_loc=slots,
        req_pool_indices=torch.tensor([row]), seq_lens=torch.tensor([len(full)]),
        extend_lens=[len(full)]))
    assert isinstance(logits, torch.Tensor)
    assert int(logits.argmax(dim=-1)[0]) == int(generated[-1])
