"""Acceptance (ranks): TP/PP parity (structured outputs too), multi-node groups, watchdog,
consensus, failure propagation."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from datetime import datetime
from pathlib import Path

import httpx
import jsonschema
import psutil
import pytest
from transformers import PreTrainedTokenizerBase

from shoal.ports import free_port
from tests.support.generate import PROMPTS, ask_capital_of_france, greedy_outputs
from tests.support.load import exit_code_under_load
from tests.support.reference import assert_same_or_tie
from tests.support.server import (
    RunningServer,
    exit_code_after_sigkill,
    kill_tree,
    shoal_processes,
    start_server,
    wait_healthy,
)
from tests.support.termination import termination_message

NEW_TOKENS = 32


def _log_time(line: str) -> datetime:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def tp1_outputs(default_server: RunningServer, prompt_ids: list[list[int]]) -> list[list[int]]:
    return greedy_outputs(default_server.base_url, prompt_ids, NEW_TOKENS)


@pytest.mark.parametrize("flags,titles", [
    (("--tp", "2"), {"shoal::scheduler_TP0", "shoal::scheduler_TP1"}),
    (("--pp", "2"), {"shoal::scheduler_PP0_TP0", "shoal::scheduler_PP1_TP0"}),
    (("--tp", "2", "--pp", "2"), {f"shoal::scheduler_PP{p}_TP{t}" for p in (0, 1)
                                  for t in (0, 1)}),
], ids=["tp2", "pp2", "tp2-pp2"])
def test_parallel_greedy_equals_tp1(tmp_path: Path, model_path: str, flags: tuple[str, ...],
                                    titles: set[str], prompt_ids: list[list[int]],
                                    tp1_outputs: list[list[int]]) -> None:
    server = start_server(tmp_path, *flags, "--max-total-tokens", "8192")
    try:
        schedulers = {t for t in server.component_pids() if t.startswith("shoal::scheduler")}
        assert schedulers == titles
        outputs = greedy_outputs(server.base_url, prompt_ids, NEW_TOKENS)
        _assert_constrained_outputs_hold(server.base_url)
    finally:
        server.stop()
    for ids, expected, got in zip(prompt_ids, tp1_outputs, outputs):
        assert len(got) == NEW_TOKENS
        assert_same_or_tie(model_path, ids, expected, got)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}


def _assert_constrained_outputs_hold(base_url: str) -> None:
    """Structured outputs across ranks: every rank's step follows the one grammar-masked token
    the sampling rank chose (greedy and sampled)."""
    for temperature in (0.0, 1.0):
        r = httpx.post(base_url + "/v1/completions", timeout=120, json={
            "prompt": "A person as JSON:", "max_tokens": 48, "temperature": temperature,
            "seed": 7, "response_format": {"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON, "strict": True}}})
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), PERSON)
        r = httpx.post(base_url + "/generate", timeout=120, json={
            "text": "A phone number:", "sampling_params": {
                "regex": "[0-9]{3}-[0-9]{4}", "temperature": temperature, "seed": 7,
                "max_new_tokens": 16}})
        assert r.status_code == 200, r.text
        assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.json()["text"]), r.json()["text"]


def test_two_nodes_form_one_server(tmp_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"
    common = ("--nnodes", "2", "--tp", "2", "--dist-init-addr", addr, "--max-total-tokens", "4096")
    node1 = start_server(tmp_path, *common, "--node-rank", "1", wait=False)
    node0 = start_server(tmp_path, *common, "--node-rank", "0", wait=False)
    try:
        wait_healthy(node0)
        assert set(node0.component_pids()) == {"shoal::api", "shoal::detokenizer",
                                               "shoal::scheduler_TP0"}
        assert set(node1.component_pids()) == {"shoal::scheduler_TP1"}
        assert httpx.get(node1.base_url + "/health", timeout=5).status_code == 200
        assert "Paris" in ask_capital_of_france(node0.base_url, max_tokens=20)
    finally:
        node0.stop()
        node1.stop()


def test_hung_rank_trips_the_watchdog(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    server = start_server(tmp_path, "--tp", "2", "--watchdog-timeout", "10",
                          "--max-total-tokens", "4096",
                          env={"SHOAL_FAULT": "hang_forward:rank=1:after_steps=5",
                               "SHOAL_TERMINATION_LOG": str(log)})
    started = time.monotonic()
    code = exit_code_under_load(server, timeout=40)
    assert code == 86
    assert time.monotonic() - started < 20 + 5  # 5 forwards, then the 10 s timeout, then exit
    text = server.log()
    assert "Scheduler watchdog timeout on rank 1" in text
    assert "running batch:" in text and "forward passes" in text
    assert re.search(r"stacks:\n(Process \d+|py-spy)", text)
    message = termination_message(log)
    assert message.reason == "watchdog" and message.exit_code == 86
    assert message.rank in (0, 1) and message.component.startswith("scheduler_TP")


def test_diverging_rank_fails_the_consensus_check(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    server = start_server(tmp_path, "--tp", "2", "--enable-rank-consensus-check",
                          "--max-total-tokens", "4096",
                          env={"SHOAL_FAULT": "diverge_consensus:rank=1:after_events=20",
                               "SHOAL_TERMINATION_LOG": str(log)})
    code = exit_code_under_load(server, timeout=60)
    assert code == 87
    lines = server.log().splitlines()
    injected = next(_log_time(ln) for ln in lines if "now records corrupted events" in ln)
    for rank in (0, 1):
        failed = next(_log_time(ln) for ln in lines
                      if f"rank consensus check failed on rank {rank}" in ln)
        assert (failed - injected).total_seconds() < 5
    message = termination_message(log)
    assert message.reason == "consensus" and message.exit_code == 87


def test_consensus_check_is_quiet_without_a_fault(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--tp", "2", "--enable-rank-consensus-check",
                          "--max-total-tokens", "4096")
    try:
        async def run() -> None:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
                sem = asyncio.Semaphore(32)

                async def one(i: int) -> None:
                    async with sem:
                        r = await client.post("/generate", json={
                            "text": f"Item {i}:", "sampling_params": {
                                "max_new_tokens": 1 + i % 6, "temperature": 0.5, "seed": i}})
                        assert r.status_code == 200
                await asyncio.gather(*(one(i) for i in range(96)))  # three waves of 32
        asyncio.run(run())
        time.sleep(1)
        assert server.proc.poll() is None
        assert "consensus check failed" not in server.log()
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("victim", ["api", "detokenizer", "scheduler_TP0", "scheduler_TP1"])
def test_sigkill_of_any_process_of_a_tp2_server(tmp_path: Path, victim: str) -> None:
    log = tmp_path / "termination-log"
    server = start_server(tmp_path, "--tp", "2", "--max-total-tokens", "4096",
                          env={"SHOAL_TERMINATION_LOG": str(log)})
    try:
        pids = server.component_pids()
        code = exit_code_after_sigkill(server, pids[f"shoal::{victim}"])
    finally:
        kill_tree(server.proc.pid)
    assert code == 128 + signal.SIGKILL
    assert not [p for p in shoal_processes() if p.pid in pids.values()
                and p.status() != psutil.STATUS_ZOMBIE]
    message = termination_message(log)
    assert message.component == victim and message.exit_code == code
