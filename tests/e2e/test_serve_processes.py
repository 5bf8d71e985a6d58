"""Acceptance: `shoal serve` answers on the default model, shows its processes, and dies whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.server import RunningServer, shoal_processes, start_server

TITLES = {"shoal::api", "shoal::detokenizer", "shoal::scheduler_TP0"}


def test_answers_capital_of_france(default_server: RunningServer) -> None:
    r = httpx.post(default_server.base_url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 40})
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_ps_shows_one_process_per_component(default_server: RunningServer) -> None:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True)
    pids = default_server.component_pids()
    assert set(pids) == TITLES
    for title, pid in pids.items():
        assert any(line.split(None, 1) == [str(pid), title] for line in
                   (ln.strip() for ln in ps.stdout.splitlines())), title


@pytest.mark.parametrize("victim", sorted(TITLES))
def test_sigkill_of_any_component_ends_the_server(tmp_path: Path, victim: str) -> None:
    termination_log = tmp_path / "termination-log"
    server = start_server(tmp_path, env={"SHOAL_TERMINATION_LOG": str(termination_log)})
    try:
        pids = server.component_pids()
        os.kill(pids[victim], signal.SIGKILL)
        started = time.monotonic()
        code = server.proc.wait(timeout=10)
        assert time.monotonic() - started < 10
        assert code != 0
        for pid in pids.values():
            assert (not psutil.pid_exists(pid)
                    or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
        assert not [p for p in shoal_processes() if p.pid in pids.values()]
        message = json.loads(termination_log.read_text())
        assert message["component"] == victim.removeprefix("shoal::")
        assert message["exit_code"] == code == 128 + signal.SIGKILL
    finally:
        server.stop()


def test_sigterm_drains_in_flight_requests(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--max-total-tokens", "4096")
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as client, client.stream(
                "POST", "/generate", json={
                    "text": "Tell me a story.", "stream": True,
                    "sampling_params": {"max_new_tokens": 48, "temperature": 0,
                                        "ignore_eos": True}}) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                server.proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        final = json.loads(rest[-2][5:])
        assert json.loads(first[5:])["meta_info"]["completion_tokens"] >= 1
        assert final["meta_info"]["completion_tokens"] == 48
        assert final["meta_info"]["finish_reason"]["type"] == "length"
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.stop()
