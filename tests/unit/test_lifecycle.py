"""Termination messages: one JSON line, first failure wins, bounded size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.lifecycle import (ExitCode, read_termination_message, reset_termination_log,
                             write_termination_message)


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "termination-log"
    monkeypatch.setenv("SHOAL_TERMINATION_LOG", str(path))
    return path


def test_first_writer_wins(log: Path) -> None:
    assert write_termination_message(ExitCode.WATCHDOG, "scheduler_TP1", 1, "stuck")
    assert not write_termination_message(ExitCode.PEER_LOST, "api", None, "peer died")
    message = read_termination_message()
    assert message == {"reason": "watchdog", "component": "scheduler_TP1", "rank": 1,
                       "exit_code": 86, "detail": "stuck"}
    assert len(log.read_text().splitlines()) == 1


def test_reset_and_size_limit(log: Path) -> None:
    write_termination_message(ExitCode.CRASH, "api", None, "x")
    reset_termination_log()
    assert read_termination_message() is None
    write_termination_message(137, "detokenizer", None, "y" * 10_000)
    text = log.read_text()
    assert len(text.encode()) <= 4096
    assert json.loads(text)["reason"] == "crash" and json.loads(text)["exit_code"] == 137


def test_peer_lost_never_shadows_the_real_failure(log: Path) -> None:
    assert write_termination_message(ExitCode.PEER_LOST, "scheduler_TP0", 0, "peer gone")
    assert write_termination_message(137, "scheduler_TP1", None, "killed by SIGKILL")
    assert not write_termination_message(ExitCode.PEER_LOST, "scheduler_TP0", 0, "again")
    assert read_termination_message()["component"] == "scheduler_TP1"
