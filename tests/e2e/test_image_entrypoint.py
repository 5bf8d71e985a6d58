"""Acceptance (image, without Docker): image/entrypoint.py runs a `--tp 2` server under supervisord
on this machine, serves OpenAI requests, drains on SIGTERM, and ends with the failed component's
exit code and termination message when one fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from shoal.ports import free_port
from tests.support.generate import ask_capital_of_france
from tests.support.load import exit_code_under_load
from tests.support.server import RunningServer, exit_code_after_sigkill, wait_healthy
from tests.support.termination import termination_message

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "image" / "entrypoint.py"
FLAGS = ("--tp", "2", "--max-total-tokens", "4096")
TITLES = {"shoal::api", "shoal::detokenizer", "shoal::scheduler_TP0", "shoal::scheduler_TP1"}


def start_appliance(tmp_path: Path, *flags: str, env: dict[str, str] | None = None
                    ) -> RunningServer:
    port = free_port()
    log_path = tmp_path / f"entrypoint-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(ENTRYPOINT), "--port", str(port), *FLAGS, *flags],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "SHOAL_TERMINATION_LOG": str(tmp_path / "termination-log"),
                 **(env or {})})
    server = RunningServer(proc=proc, base_url=f"http://127.0.0.1:{port}", log_path=log_path)
    wait_healthy(server)
    return server


def _tree(server: RunningServer) -> list[psutil.Process]:
    return psutil.Process(server.proc.pid).children(recursive=True)


def _left_running(procs: list[psutil.Process]) -> list[psutil.Process]:
    left = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(proc)
        except psutil.NoSuchProcess:
            pass
    return left


def _stream_completion(base_url: str, max_tokens: int, first_chunk: threading.Event,
                       result: dict) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks, result["done"] = [], False
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as r:
        result["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
                first_chunk.set()
            result["done"] = result["done"] or line == "data: [DONE]"
    result["chunks"] = chunks
    result["finished_at"] = time.monotonic()


def test_serves_under_supervisord_and_drains_on_sigterm(tmp_path: Path) -> None:
    server = start_appliance(tmp_path)
    try:
        tree = _tree(server)
        supervisord = [p for p in tree if "supervisor.supervisord" in " ".join(p.cmdline())]
        assert len(supervisord) == 1 and supervisord[0].ppid() == server.proc.pid
        components = {" ".join(p.cmdline()).strip(): p for p in tree
                      if p.ppid() == supervisord[0].pid and p.cmdline()[0].startswith("shoal::")}
        assert set(components) == TITLES  # exactly one scheduler per rank
        assert any("exit_listener.py" in " ".join(p.cmdline()) for p in tree)

        assert "Paris" in ask_capital_of_france(server.base_url)

        first_chunk, result = threading.Event(), {}
        client = threading.Thread(target=_stream_completion,
                                  args=(server.base_url, 48, first_chunk, result))
        client.start()
        assert first_chunk.wait(timeout=60)
        server.proc.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        code = server.proc.wait(timeout=60)
        client.join(timeout=10)
    finally:
        server.stop()
    assert code == 0
    # the in-flight request was finished after the SIGTERM, not cut off
    assert result["status"] == 200 and result["done"]
    assert result["finished_at"] > sigterm_at
    assert result["chunks"][-1]["usage"]["completion_tokens"] == 48
    assert [c["choices"][0]["finish_reason"] for c in result["chunks"] if c["choices"]][-1] \
        == "length"
    assert not _left_running(tree)
    assert not (tmp_path / "termination-log").exists() or \
        not (tmp_path / "termination-log").read_text().strip()


def test_sigkill_of_a_rank_ends_the_entrypoint_with_its_code(tmp_path: Path) -> None:
    server = start_appliance(tmp_path)
    try:
        tree = _tree(server)
        victim = next(p for p in tree if p.cmdline()[0].strip() == "shoal::scheduler_TP1")
        code = exit_code_after_sigkill(server, victim.pid)
    finally:
        server.stop()
    assert code == 128 + signal.SIGKILL
    assert not _left_running(tree)
    message = termination_message(tmp_path / "termination-log")
    assert (message.component, message.rank, message.exit_code) == ("scheduler_TP1", 1, 137)
    assert "SIGKILL" in message.detail


def test_hung_rank_trips_the_watchdog_and_the_entrypoint_exits_86(tmp_path: Path) -> None:
    server = start_appliance(tmp_path, "--watchdog-timeout", "10",
                             env={"SHOAL_FAULT": "hang_forward:rank=1:after_steps=5"})
    tree = _tree(server)
    code = exit_code_under_load(server, timeout=60)
    assert code == 86
    assert not _left_running(tree)
    message = termination_message(tmp_path / "termination-log")
    assert (message.reason, message.exit_code) == ("watchdog", 86)
    assert message.component.startswith("scheduler_TP")
