"""Why a component ended (the one classifier), which end speaks for the server, and the
termination message: one JSON line, first failure wins, bounded size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal import lifecycle
from shoal.lifecycle import (
    PEER_LOST_GRACE_S,
    SUPERVISORD_FATAL,
    ExitCode,
    FirstFailure,
    Reason,
    Termination,
    classify_exit,
    parse_termination_message,
    reset_termination_log,
    write_termination_message,
)


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "termination-log"
    monkeypatch.setenv("SHOAL_TERMINATION_LOG", str(path))
    return path


def _end(reason: Reason, component: str, rank: int | None, code: int, detail: str) -> Termination:
    return Termination(reason, component, rank, code, detail)


@pytest.mark.parametrize("status,expected,reason,code,detail", [
    (0, True, Reason.COMPLETED, 0, "shoal::scheduler_TP1 exited with 0"),
    (0, False, Reason.CRASH, 1, "shoal::scheduler_TP1 exited unexpectedly"),
    (1, False, Reason.CRASH, 1, "shoal::scheduler_TP1 exited with 1"),
    (75, False, Reason.PEER_LOST, 75, "shoal::scheduler_TP1 exited with 75"),
    (86, False, Reason.WATCHDOG, 86, "shoal::scheduler_TP1 exited with 86"),
    (87, False, Reason.CONSENSUS, 87, "shoal::scheduler_TP1 exited with 87"),
    (88, False, Reason.STARTUP_FAILED, 88, "shoal::scheduler_TP1 exited with 88"),
    (3, False, Reason.CRASH, 3, "shoal::scheduler_TP1 exited with 3"),
    (-9, False, Reason.CRASH, 137, "shoal::scheduler_TP1 killed by SIGKILL"),
    ("SIGKILL", False, Reason.CRASH, 137, "shoal::scheduler_TP1 killed by SIGKILL"),
    (143, False, Reason.CRASH, 143, "shoal::scheduler_TP1 killed by SIGTERM"),
    (None, False, Reason.CRASH, 1, "shoal::scheduler_TP1 exited (exit status unknown)"),
])
def test_classify_exit_status(status: int | str | None, expected: bool, reason: Reason,
                              code: int, detail: str) -> None:
    assert classify_exit(status, component="scheduler_TP1", rank=1, expected=expected) == _end(
        reason, "scheduler_TP1", 1, code, detail)


def test_the_message_names_the_component_that_failed() -> None:
    message = _end(Reason.WATCHDOG, "scheduler_TP1", 1, 86, "stuck").to_json()
    assert classify_exit(86, component="engine", message=message) == _end(
        Reason.WATCHDOG, "scheduler_TP1", 1, 86, "stuck")
    # a foreign message (Kubernetes' log-tail fallback) is ignored
    assert classify_exit(86, component="engine", message="Traceback ...\n").reason == (
        Reason.WATCHDOG)


def test_a_stale_message_does_not_explain_an_unexpected_clean_exit() -> None:
    message = _end(Reason.WATCHDOG, "scheduler_TP1", 1, 86, "stuck").to_json()
    assert classify_exit(0, component="engine", message=message).detail == (
        "shoal::engine exited unexpectedly")


def test_the_platform_says_oom() -> None:
    end = classify_exit(137, component="engine", rank=0, platform_reason="OOMKilled")
    assert (end.reason, end.exit_code) == (Reason.OOM, 137)


def test_first_failure_prefers_the_cause_of_a_peer_lost() -> None:
    first = FirstFailure()
    peer_lost = _end(Reason.PEER_LOST, "scheduler_TP0", 0, 75, "peer")
    assert first.on_end(peer_lost, now=100.0) is None
    assert first.seconds_left(now=100.5) == pytest.approx(PEER_LOST_GRACE_S - 0.5)
    assert first.on_tick(now=100.5) is None
    cause = _end(Reason.WATCHDOG, "scheduler_TP1", 1, 86, "watchdog")
    assert first.on_end(cause, now=101.0) == cause

    first = FirstFailure()
    assert first.on_end(peer_lost, now=0.0) is None
    assert first.on_tick(now=PEER_LOST_GRACE_S) == peer_lost  # nothing else failed
    assert FirstFailure().seconds_left(now=0.0) is None


def test_first_writer_wins(log: Path) -> None:
    assert write_termination_message(_end(Reason.WATCHDOG, "scheduler_TP1", 1, 86, "stuck"))
    assert not write_termination_message(_end(Reason.PEER_LOST, "api", None, 75, "peer died"))
    assert json.loads(log.read_text()) == {"reason": "watchdog", "component": "scheduler_TP1",
                                           "rank": 1, "exit_code": 86, "detail": "stuck"}
    assert parse_termination_message(log.read_text()) == _end(Reason.WATCHDOG, "scheduler_TP1",
                                                              1, 86, "stuck")
    assert len(log.read_text().splitlines()) == 1


def test_reset_and_size_limit(log: Path) -> None:
    write_termination_message(_end(Reason.CRASH, "api", None, 1, "x"))
    reset_termination_log()
    assert parse_termination_message(log.read_text()) is None
    write_termination_message(_end(Reason.CRASH, "detokenizer", None, 137, "y" * 10_000))
    text = log.read_text()
    assert len(text.encode()) <= 4096
    assert json.loads(text)["reason"] == "crash" and json.loads(text)["exit_code"] == 137


def test_peer_lost_never_shadows_the_real_failure(log: Path) -> None:
    assert write_termination_message(_end(Reason.PEER_LOST, "scheduler_TP0", 0, 75, "peer gone"))
    assert write_termination_message(
        classify_exit(-9, component="scheduler_TP1", rank=1))
    assert not write_termination_message(_end(Reason.PEER_LOST, "scheduler_TP0", 0, 75, "again"))
    message = parse_termination_message(log.read_text())
    assert message is not None and message.component == "scheduler_TP1"


def test_a_component_started_after_its_parent_died_is_peer_lost(
        log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exits: list[int] = []
    monkeypatch.setattr(lifecycle, "set_parent_death_signal", lambda sig: None)
    monkeypatch.setattr(lifecycle.os, "getppid", lambda: 1)  # re-parented to init
    monkeypatch.setattr(lifecycle, "exit_process", exits.append)
    lifecycle.die_with_parent("scheduler_TP1", 1)
    assert exits == [ExitCode.PEER_LOST]
    message = parse_termination_message(log.read_text())
    assert message is not None and (message.reason, message.rank) == (Reason.PEER_LOST, 1)


def test_supervisord_fatal_is_a_startup_failure() -> None:
    end = classify_exit(None, component="api", platform_reason=SUPERVISORD_FATAL)
    assert (end.reason, end.exit_code) == (Reason.STARTUP_FAILED, ExitCode.STARTUP_FAILED)
