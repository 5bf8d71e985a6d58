"""How a component ends: exit codes, the termination message, dying with its parent.

See DESIGN.md section 4 and docs/operations.md.
"""

from __future__ import annotations

import ctypes
import enum
import fcntl
import json
import logging
import os
import signal
from pathlib import Path

logger = logging.getLogger(__name__)

TERMINATION_LOG_ENV = "SHOAL_TERMINATION_LOG"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
MAX_MESSAGE_BYTES = 4096
_PR_SET_PDEATHSIG = 1


class ExitCode(enum.IntEnum):
    COMPLETED = 0
    CRASH = 1
    PEER_LOST = 75
    WATCHDOG = 86
    CONSENSUS = 87
    STARTUP_FAILED = 88


REASONS = {
    ExitCode.COMPLETED: "completed",
    ExitCode.CRASH: "crash",
    ExitCode.PEER_LOST: "peer-lost",
    ExitCode.WATCHDOG: "watchdog",
    ExitCode.CONSENSUS: "consensus",
    ExitCode.STARTUP_FAILED: "startup-failed",
}


def termination_log_path() -> Path | None:
    configured = os.environ.get(TERMINATION_LOG_ENV)
    if configured:
        return Path(configured)
    default = Path(DEFAULT_TERMINATION_LOG)
    if default.exists() and os.access(default, os.W_OK):
        return default
    return None


def termination_message(code: int, component: str, rank: int | None, detail: str) -> str:
    reason = REASONS.get(code, "crash")  # type: ignore[call-overload]
    record = {"reason": reason, "component": component, "rank": rank, "exit_code": code,
              "detail": detail}
    line = json.dumps(record)
    while len(line.encode()) > MAX_MESSAGE_BYTES - 1:
        record["detail"] = record["detail"][: len(record["detail"]) // 2] + "..."
        line = json.dumps(record)
    return line


def write_termination_message(code: int, component: str, rank: int | None, detail: str) -> bool:
    """Record why this server is ending, unless an earlier failure already did (first one wins;
    but a `peer-lost` message never shadows the failure that caused it)."""
    path = termination_log_path()
    line = termination_message(code, component, rank, detail)
    logger.error("termination: %s", line)
    if path is None:
        return False
    try:
        with open(path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            existing = f.read().strip()
            if existing and not (_is_peer_lost(existing) and code != ExitCode.PEER_LOST):
                return False
            f.seek(0)
            f.truncate()
            f.write(line + "\n")
            return True
    except OSError as exc:
        logger.warning("cannot write termination message to %s: %s", path, exc)
        return False


def _is_peer_lost(line: str) -> bool:
    try:
        return json.loads(line.splitlines()[0]).get("reason") == REASONS[ExitCode.PEER_LOST]
    except (ValueError, AttributeError):
        return False


def reset_termination_log() -> None:
    """Start a server with an empty termination log, so a stale message cannot shadow this run's."""
    path = termination_log_path()
    if path is not None and path.exists() and path.is_file():
        path.write_text("")


def read_termination_message() -> dict | None:
    path = termination_log_path()
    if path is None or not path.exists():
        return None
    text = path.read_text().strip()
    return json.loads(text.splitlines()[0]) if text else None


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(ExitCode.PEER_LOST)


def exit_process(code: int) -> None:
    """Exit at once, without running atexit hooks that could block on a broken peer."""
    logging.shutdown()
    os._exit(code)
