"""`shoal bench forward` on the default model at tiny sizes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shoal.bench.forward import alloc_rows, decode_step, prefill
from shoal.cli import main
from shoal.config import ServerArgs
from shoal.cpu_cores import usable_cores
from shoal.engine.model_runner import ModelRunner
from shoal.engine.threads import RankThreads
from shoal.models.forward_batch import ForwardBatch
from shoal.models.parallel import ParallelGroup
from shoal.scheduler.process import chunked_prefill_size


@pytest.fixture(autouse=True)
def keep_torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_forward_command_reports_tokens_per_second(tmp_path: Path) -> None:
    out = tmp_path / "forward.json"
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "forward", "--batch-size", "3", "--input-len", "24", "--output-len", "4",
              "--prefill-tokens", "40", "--output-file", str(out)])
    assert time.monotonic() - start < 20
    assert exit_info.value.code == 0
    data = json.loads(out.read_text())
    r = data["result"]
    assert (r["batch_size"], r["input_len"], r["output_len"], r["prefill_tokens"]) == (3, 24, 4, 40)
    assert r["num_threads"] == RankThreads.for_host(usable_cores(), 1, spare_core=False).base
    assert (r["device"], r["dtype"]) == ("cpu", "float32")
    assert r["prefill_s"] > 0 and r["decode_s"] > 0
    assert r["total_s"] == pytest.approx(r["prefill_s"] + r["decode_s"])
    assert r["tokens_per_s"] == pytest.approx(3 * 4 / r["total_s"])
    assert r["decode_tokens_per_s"] == pytest.approx(3 * 3 / r["decode_s"])
    assert r["mean_step_ms"] == pytest.approx(1000 * r["decode_s"] / 3)
    assert r["p50_step_ms"] <= r["max_step_ms"]
    assert data["config"]["model_path"]


def test_the_prefill_budget_defaults_to_the_schedulers(tmp_path: Path) -> None:
    out = tmp_path / "forward.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "forward", "--batch-size", "1", "--input-len", "8", "--output-len", "2",
              "--warmup-steps", "0", "--output-file", str(out)])
    assert exit_info.value.code == 0
    assert json.loads(out.read_text())["result"]["prefill_tokens"] == chunked_prefill_size(
        ServerArgs(), torch.device("cpu"))


@pytest.mark.parametrize("flag", ["--batch-size", "--input-len", "--output-len",
                                  "--prefill-tokens"])
def test_forward_rejects_empty_sizes(flag: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "forward", flag, "0"])
    assert exit_info.value.code == 2


def test_chunked_prefill_decodes_like_a_full_prefill(model_path: str) -> None:
    """Prompts split across prefill forwards of 16 tokens (one prompt's later part extending the
    K/V its earlier part wrote, beside another prompt's start): each row's tokens are what a
    from-scratch prefill of its prompt + generated tokens predicts."""
    torch.manual_seed(0)
    runner = ModelRunner(model_path, torch.device("cpu"), torch.float32, ParallelGroup(),
                         max_total_tokens=512, max_running_requests=4, context_length=64)
    rows = alloc_rows(runner, 3)
    prompts = [torch.randint(0, runner.model_config.vocab_size, (20,), dtype=torch.int64)
               for _ in rows]
    tokens = [prefill(runner, rows, prompts, budget=16)]
    for step in range(3):
        tokens.append(decode_step(runner, rows, 20 + step, tokens[-1]))

    for r, prompt in enumerate(prompts):
        generated = torch.stack([t[r] for t in tokens])
        full = torch.cat([prompt, generated[:-1]])
        (row,) = alloc_rows(runner, 1)
        slots = runner.token_allocator.alloc(len(full))
        assert slots is not None
        runner.req_to_token_pool.table[row, :len(full)] = slots
        logits = runner.forward(ForwardBatch(
            input_ids=full, positions=torch.arange(len(full)), out_cache_loc=slots,
            req_pool_indices=torch.tensor([row]), seq_lens=torch.tensor([len(full)]),
            extend_lens=[len(full)], logit_indices=torch.arange(19, len(full))))
        assert isinstance(logits, torch.Tensor)
        assert logits.argmax(dim=-1).tolist() == generated.tolist()
        runner.req_to_token_pool.free(row)
