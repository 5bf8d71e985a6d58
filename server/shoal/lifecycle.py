"""How a component ends: exit codes, why it ended, the termination message, dying with its parent.

The one place that turns "how did it end" into "why": `classify_exit` maps an exit status or
signal, the termination message and the platform's reason (Kubernetes' `OOMKilled`) to a
`Termination`. `shoal serve`, the image's supervisord listener and entrypoint, and the operator
all classify through it; `FirstFailure` picks which of several ends speaks for the server.

Which code is raised where (docs/contracts.md has the same table for operators;
tests/e2e/test_exit_codes.py triggers each row for real):

| code  | reason           | raised by                                                          |
|-------|------------------|--------------------------------------------------------------------|
| 0     | `completed`      | a component whose entry returns or that gets SIGTERM               |
|       |                  | (`launch.component.run_component`, `exit_on_sigterm`)              |
| 1     | `crash`          | any uncaught exception, and the injected crash                     |
|       |                  | (`launch.component.run_component`); a runner's verdict on a        |
|       |                  | component that exits 0 while nothing asked it to stop              |
| 75    | `peer-lost`      | `PeerLost`, raised where a collective fails                        |
|       |                  | (`models.parallel.peer_lost_on_error`); a component started after  |
|       |                  | its parent had exited (`die_with_parent`)                          |
| 86    | `watchdog`       | `scheduler.watchdog.Watchdog`: no forward progress with work to do |
| 87    | `consensus`      | `scheduler.consensus.ConsensusChecker`: ranks hashed different     |
|       |                  | decisions                                                          |
| 88    | `startup-failed` | `StartupFailed` or `ConfigError` in a component                    |
|       |                  | (`launch.component.run_component`): a model or tokenizer that      |
|       |                  | cannot load; bad flags or environment (`cli`, image/entrypoint.py);|
|       |                  | a program supervisord cannot start (`SUPERVISORD_FATAL`)           |
| 128+N | `crash` / `oom`  | killed by signal N from outside (`classify_exit`); `oom` when the  |
|       |                  | platform says so (`OOM_KILLED`)                                    |
"""

from __future__ import annotations

import ctypes
import enum
import fcntl
import json
import logging
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import NoReturn

logger = logging.getLogger(__name__)

TERMINATION_LOG_ENV = "SHOAL_TERMINATION_LOG"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
MAX_MESSAGE_BYTES = 4096
PEER_LOST_GRACE_S = 2.0  # how long a peer-lost end waits for the failure that caused it
_PR_SET_PDEATHSIG = 1


class ExitCode(enum.IntEnum):
    COMPLETED = 0
    CRASH = 1
    PEER_LOST = 75
    WATCHDOG = 86
    CONSENSUS = 87
    STARTUP_FAILED = 88


class Reason(enum.StrEnum):
    COMPLETED = "completed"
    CRASH = "crash"
    PEER_LOST = "peer-lost"
    WATCHDOG = "watchdog"
    CONSENSUS = "consensus"
    STARTUP_FAILED = "startup-failed"
    OOM = "oom"


_REASON_OF_CODE = {
    ExitCode.COMPLETED: Reason.COMPLETED,
    ExitCode.CRASH: Reason.CRASH,
    ExitCode.PEER_LOST: Reason.PEER_LOST,
    ExitCode.WATCHDOG: Reason.WATCHDOG,
    ExitCode.CONSENSUS: Reason.CONSENSUS,
    ExitCode.STARTUP_FAILED: Reason.STARTUP_FAILED,
}
OOM_KILLED = "OOMKilled"  # Kubernetes' container reason when the kernel's OOM killer struck
SUPERVISORD_FATAL = "FATAL"  # supervisord's state for a program it could not start


class StartupFailed(RuntimeError):
    """The component cannot start (bad config, a model or tokenizer that cannot load): it exits
    88 and is not hot-restarted."""


class PeerLost(Exception):  # noqa: N818 - named for the reason it stands for
    """A collective failed because another rank went away: the rank exits 75. Not a
    RuntimeError, so startup code that turns load errors into `StartupFailed` lets it through."""


@dataclass(frozen=True)
class Termination:
    """Why one component (or container) ended: the termination message's fields."""

    reason: Reason
    component: str
    rank: int | None
    exit_code: int
    detail: str

    def to_json(self) -> str:
        """The termination message: one JSON line of at most MAX_MESSAGE_BYTES."""
        record = asdict(self)
        record["reason"] = str(self.reason)
        line = json.dumps(record)
        while len(line.encode()) > MAX_MESSAGE_BYTES - 1:
            record["detail"] = record["detail"][: len(record["detail"]) // 2] + "..."
            line = json.dumps(record)
        return line


def exit_code_of(status: int | str | None) -> int | None:
    """An exit status in any of its spellings as one exit code: an int (negative = killed by that
    signal, subprocess' convention), a signal name (`SIGKILL`, supervisord's log), or None."""
    if isinstance(status, str):
        return 128 + signal.Signals[status]
    if status is not None and status < 0:
        return 128 - status
    return status


def classify_exit(status: int | str | None, *, component: str, rank: int | None = None,
                  message: str | None = None, platform_reason: str | None = None,
                  expected: bool = False) -> Termination:
    """Why `component` ended, from what its supervisor saw. Pure.

    status           exit code, negative signal number, signal name, or None when unknown
    message          the termination message the component (or its supervisor) wrote, if any;
                     its reason, component, rank and detail win over the guess from `status`
    platform_reason  the platform's word for the end (Kubernetes: `OOMKilled`, `Error`, ...;
                     supervisord: `FATAL`, a program it could not start)
    expected         the supervisor asked it to stop, so exit 0 is `completed`, not a crash
    """
    code = exit_code_of(status)
    recorded = parse_termination_message(message)
    if platform_reason == SUPERVISORD_FATAL:
        return Termination(Reason.STARTUP_FAILED, component, rank, ExitCode.STARTUP_FAILED,
                           f"{_title(component)} could not be started (supervisord: FATAL)")
    if platform_reason == OOM_KILLED:
        detail = recorded.detail if recorded else f"{_title(component)} was OOM-killed"
        return Termination(Reason.OOM, recorded.component if recorded else component,
                           recorded.rank if recorded else rank,
                           code if code is not None else 137, detail)
    if recorded is not None and (code is None or code != ExitCode.COMPLETED or expected):
        exit_code = code if code is not None else recorded.exit_code
        return Termination(recorded.reason, recorded.component, recorded.rank, exit_code,
                           recorded.detail)
    if code is None:
        return Termination(Reason.CRASH, component, rank, ExitCode.CRASH,
                           f"{_title(component)} exited (exit status unknown)")
    if code == ExitCode.COMPLETED and not expected:
        return Termination(Reason.CRASH, component, rank, ExitCode.CRASH,
                           f"{_title(component)} exited unexpectedly")
    if code > 128 and code - 128 in signal.valid_signals():
        name = signal.Signals(code - 128).name
        return Termination(Reason.CRASH, component, rank, code,
                           f"{_title(component)} killed by {name}")
    reason = _REASON_OF_CODE.get(code, Reason.CRASH)  # type: ignore[call-overload]
    return Termination(reason, component, rank, code, f"{_title(component)} exited with {code}")


def _title(component: str) -> str:
    return f"shoal::{component}"


def parse_termination_message(message: str | None) -> Termination | None:
    """A termination message as written by `Termination.to_json`; None when absent or foreign
    (Kubernetes falls back to the log tail, which is no message of ours)."""
    if not message or not message.strip():
        return None
    try:
        record = json.loads(message.strip().splitlines()[0])
        return Termination(Reason(record["reason"]), str(record["component"]),
                           None if record.get("rank") is None else int(record["rank"]),
                           int(record["exit_code"]), str(record.get("detail", "")))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class FirstFailure:
    """Which of a server's component ends speaks for it. The first end that is not `peer-lost`
    wins; a `peer-lost` end is a consequence of another failure that is often seen a moment
    later, so it wins only when nothing else ends within PEER_LOST_GRACE_S."""

    def __init__(self, grace_s: float = PEER_LOST_GRACE_S) -> None:
        self.grace_s = grace_s
        self.peer_lost: Termination | None = None
        self.peer_lost_at = 0.0

    def on_end(self, end: Termination, now: float) -> Termination | None:
        """The failure that ends the server, once it is known; None while waiting."""
        if end.reason != Reason.PEER_LOST:
            return end
        if self.peer_lost is None:
            self.peer_lost, self.peer_lost_at = end, now
        return self.on_tick(now)

    def on_tick(self, now: float) -> Termination | None:
        if self.peer_lost is not None and now - self.peer_lost_at >= self.grace_s:
            return self.peer_lost
        return None

    def seconds_left(self, now: float) -> float | None:
        """How long to wait for the next end before `on_tick` (None: no deadline)."""
        if self.peer_lost is None:
            return None
        return max(0.0, self.peer_lost_at + self.grace_s - now)


def termination_log_path() -> Path | None:
    configured = os.environ.get(TERMINATION_LOG_ENV)
    if configured:
        return Path(configured)
    default = Path(DEFAULT_TERMINATION_LOG)
    if default.exists() and os.access(default, os.W_OK):
        return default
    return None


def write_termination_message(end: Termination) -> bool:
    """Record why this server is ending, unless an earlier failure already did (first one wins;
    but a `peer-lost` message never shadows the failure that caused it)."""
    path = termination_log_path()
    line = end.to_json()
    logger.error("termination: %s", line)
    if path is None:
        return False
    try:
        with open(path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            existing = parse_termination_message(f.read())
            if existing is not None and not (existing.reason == Reason.PEER_LOST
                                             and end.reason != Reason.PEER_LOST):
                return False
            f.seek(0)
            f.truncate()
            f.write(line + "\n")
            return True
    except OSError as exc:
        logger.warning("cannot write termination message to %s: %s", path, exc)
        return False


def fail(code: ExitCode, component: str, rank: int | None, detail: str) -> NoReturn:
    """Write the termination message for `code` and exit with it at once."""
    write_termination_message(Termination(_REASON_OF_CODE[code], component, rank, code, detail))
    exit_process(code)


def reset_termination_log() -> None:
    """Start a server with an empty termination log, so a stale message cannot shadow this run's."""
    path = termination_log_path()
    if path is not None and path.exists() and path.is_file():
        path.write_text("")


def set_parent_death_signal(sig: signal.Signals) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits (PR_SET_PDEATHSIG)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def die_with_parent(component: str, rank: int | None) -> None:
    """SIGKILL this process when its parent exits; exit 75 (`peer-lost`) at once when the parent
    is gone already (the process was re-parented to init)."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() == 1:
        fail(ExitCode.PEER_LOST, component, rank, f"{_title(component)} started after its "
             "parent process had exited")


def exit_on_sigterm() -> None:
    """Make SIGTERM a clean exit (0): raise SystemExit in the main thread, so `finally` blocks
    run. uvicorn re-raises SIGTERM to the previous handler after its graceful shutdown; this one
    ends the process with 0 rather than by the signal."""
    signal.signal(signal.SIGTERM, _raise_system_exit)


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(ExitCode.COMPLETED)


def exit_process(code: int) -> NoReturn:
    """Exit at once, without running atexit hooks that could block on a broken peer."""
    logging.shutdown()
    os._exit(code)
