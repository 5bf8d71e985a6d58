"""Acceptance: `shoal serve` answers on the default model, shows its processes, and dies whole."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.generate import ask_capital_of_france
from tests.support.server import (
    RunningServer,
    exit_code_after_sigkill,
    shoal_processes,
    start_server,
)
from tests.support.termination import termination_message

TITLES = {"shoal::api", "shoal::detokenizer", "shoal::scheduler_TP0"}


def test_answers_capital_of_france(default_server: RunningServer) -> None:
    assert "Paris" in ask_capital_of_france(default_server.base_url)


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
        code = exit_code_after_sigkill(server, pids[victim])
        for pid in pids.values():
            assert (not psutil.pid_exists(pid)
                    or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
        assert not [p for p in shoal_processes() if p.pid in pids.values()]
        message = termination_message(termination_log)
        assert message.component == victim.removeprefix("shoal::")
        assert message.exit_code == code == 128 + signal.SIGKILL
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
