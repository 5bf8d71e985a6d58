"""supervisord event listener: when a program of the server exits or goes FATAL, stop the server.

It decides which exit ends the server (the first that is not `peer-lost`; a `peer-lost` exit only
when nothing else fails within PEER_LOST_GRACE_S, as `shoal serve` does), then

1. writes the termination message on the program's behalf (a no-op when the program wrote its
   own; a program killed by a signal cannot), through `shoal.lifecycle`;
2. writes the exit record (`--record`, JSON) that the entrypoint exits with;
3. asks supervisord to shut down (SIGTERM), and stops every program at once: SIGTERM to each
   process group, SIGKILL after `--grace` seconds. A failed server does not drain.

supervisord's PROCESS_STATE_EXITED event carries no exit status, so it is read from
supervisord's own log line `exited: NAME (exit status N; ...)` / `(terminated by SIGKILL; ...)`.
Programs stopped by supervisord itself end STOPPED, not EXITED, so a clean shutdown is never
taken for a failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import select
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from shoal.lifecycle import ExitCode, write_termination_message

logger = logging.getLogger("shoal.exit_listener")

PEER_LOST_GRACE_S = 2.0
EXIT_STATUS_WAIT_S = 2.0  # how long to look for supervisord's log line of an exit
LOG_TAIL_BYTES = 256 * 1024
_EXITED = re.compile(r"exited: (?P<name>\S+) \((?:exit status (?P<code>\d+)"
                     r"|terminated by (?P<signal>SIG[A-Z0-9]+))")


@dataclass(frozen=True)
class Failure:
    component: str
    rank: int | None
    exit_code: int
    detail: str


def exit_failure(name: str, rank: int | None, status: int | str | None) -> Failure:
    """The failure of a program that exited with `status`: an exit code, a signal name from
    supervisord's log, or None when it is not known."""
    title = f"shoal::{name}"
    if isinstance(status, str):
        signum = signal.Signals[status]
        return Failure(name, rank, 128 + signum, f"{title} killed by {status}")
    if status is None:
        return Failure(name, rank, ExitCode.CRASH, f"{title} exited (exit status unknown)")
    if status == 0:
        return Failure(name, rank, ExitCode.CRASH, f"{title} exited unexpectedly")
    return Failure(name, rank, status, f"{title} exited with {status}")


def fatal_failure(name: str, rank: int | None) -> Failure:
    return Failure(name, rank, ExitCode.STARTUP_FAILED,
                   f"shoal::{name} could not be started (supervisord: FATAL)")


def exit_status_from_log(log_text: str, name: str) -> int | str | None:
    """The last recorded exit of `name` in supervisord's log: an exit code or a signal name."""
    status: int | str | None = None
    for match in _EXITED.finditer(log_text):
        if match["name"] == name:
            status = int(match["code"]) if match["code"] is not None else match["signal"]
    return status


class ExitTracker:
    """Which program's end ends the server. A rank that exits `peer-lost` is a consequence of
    another failure that is often seen a moment later, so that one is preferred."""

    def __init__(self) -> None:
        self.peer_lost: Failure | None = None
        self.peer_lost_at = 0.0

    def on_failure(self, failure: Failure, now: float) -> Failure | None:
        if failure.exit_code != ExitCode.PEER_LOST:
            return failure
        if self.peer_lost is None:
            self.peer_lost, self.peer_lost_at = failure, now
        return self.on_tick(now)

    def on_tick(self, now: float) -> Failure | None:
        if self.peer_lost is not None and now - self.peer_lost_at >= PEER_LOST_GRACE_S:
            return self.peer_lost
        return None

    def seconds_left(self, now: float) -> float | None:
        """How long to wait for the next event before `on_tick` (None: no deadline)."""
        if self.peer_lost is None:
            return None
        return max(0.0, self.peer_lost_at + PEER_LOST_GRACE_S - now)


def parse_tokens(line: str) -> dict[str, str]:
    """`key:value key:value` (an event header, or a PROCESS_STATE payload)."""
    return dict(token.split(":", 1) for token in line.split() if ":" in token)


class EventChannel:
    """supervisord's event listener protocol on stdin/stdout, with a timeout on the wait."""

    def __init__(self, fd_in: int, out: object) -> None:
        self.fd_in = fd_in
        self.out = out
        self.buffer = b""
        self.is_ready = False

    def _fill(self, deadline: float | None) -> bool:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        readable, _, _ = select.select([self.fd_in], [], [], timeout)
        if not readable:
            return False
        chunk = os.read(self.fd_in, 65536)
        if not chunk:
            raise EOFError("supervisord closed the event channel")
        self.buffer += chunk
        return True

    def next_event(self, timeout: float | None) -> tuple[dict[str, str], str] | None:
        """(header, payload) of the next event, or None when `timeout` passes first."""
        if not self.is_ready:
            self.out.write("READY\n")  # type: ignore[attr-defined]
            self.out.flush()  # type: ignore[attr-defined]
            self.is_ready = True
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            if not self._fill(deadline):
                return None
        line, _, self.buffer = self.buffer.partition(b"\n")
        header = parse_tokens(line.decode())
        length = int(header["len"])
        while len(self.buffer) < length:
            self._fill(None)  # the payload follows its header at once
        payload, self.buffer = self.buffer[:length], self.buffer[length:]
        self.is_ready = False
        return header, payload.decode()

    def ok(self) -> None:
        self.out.write("RESULT 2\nOK")  # type: ignore[attr-defined]
        self.out.flush()  # type: ignore[attr-defined]


class ExitListener:
    def __init__(self, ranks: dict[str, int | None], record: Path, supervisord_log: Path,
                 grace_s: float) -> None:
        self.ranks = ranks
        self.record = record
        self.supervisord_log = supervisord_log
        self.grace_s = grace_s
        self.pids: dict[str, int] = {}
        self.tracker = ExitTracker()
        self.failure: Failure | None = None

    def run(self, channel: EventChannel) -> None:
        while True:
            event = channel.next_event(None if self.failure else
                                       self.tracker.seconds_left(time.monotonic()))
            failure = None
            if event is None:
                failure = self.tracker.on_tick(time.monotonic())
            else:
                header, payload = event
                channel.ok()
                if self.failure is None:
                    failure = self.on_event(header["eventname"], parse_tokens(payload))
            if failure is not None and self.failure is None:
                self.failure = failure
                self.stop_server(failure)

    def on_event(self, eventname: str, payload: dict[str, str]) -> Failure | None:
        name = payload.get("processname", "")
        if name not in self.ranks:
            return None
        if eventname == "PROCESS_STATE_RUNNING":
            self.pids[name] = int(payload["pid"])
            return None
        if eventname == "PROCESS_STATE_FATAL":
            return self.tracker.on_failure(fatal_failure(name, self.ranks[name]),
                                           time.monotonic())
        if eventname == "PROCESS_STATE_EXITED":
            self.pids.pop(name, None)
            failure = exit_failure(name, self.ranks[name], self._exit_status(name))
            logger.error("%s exited: %s", name, failure.detail)
            return self.tracker.on_failure(failure, time.monotonic())
        return None

    def _exit_status(self, name: str) -> int | str | None:
        deadline = time.monotonic() + EXIT_STATUS_WAIT_S
        while True:
            status = exit_status_from_log(self._log_tail(), name)
            if status is not None or time.monotonic() > deadline:
                return status
            time.sleep(0.05)

    def _log_tail(self) -> str:
        try:
            with open(self.supervisord_log, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop_server(self, failure: Failure) -> None:
        logger.error("%s failed (exit code %d): stopping the server", failure.component,
                     failure.exit_code)
        write_termination_message(failure.exit_code, failure.component, failure.rank,
                                  failure.detail)
        staging = self.record.with_suffix(".tmp")
        staging.write_text(json.dumps(asdict(failure)) + "\n")
        staging.rename(self.record)
        os.kill(os.getppid(), signal.SIGTERM)  # supervisord: shut down
        stop_process_groups(list(self.pids.values()), self.grace_s)


def stop_process_groups(pids: list[int], grace_s: float) -> None:
    """SIGTERM every program's process group now, SIGKILL what is left after `grace_s`."""
    _signal_groups(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_is_running(pid) for pid in pids):
        time.sleep(0.1)
    _signal_groups([pid for pid in pids if _is_running(pid)], signal.SIGKILL)


def _signal_groups(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)  # supervisord makes every program a process group leader
        except ProcessLookupError:
            pass


def _is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def parse_component(text: str) -> tuple[str, int | None]:
    name, sep, rank = text.partition("=")
    return name, int(rank) if sep else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--supervisord-log", type=Path, required=True)
    parser.add_argument("--grace", type=float, default=5.0)
    parser.add_argument("--component", action="append", type=parse_component, default=[],
                        help="NAME or NAME=RANK, once per program of the server")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s [exit_listener] %(levelname)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    listener = ExitListener(dict(ns.component), ns.record, ns.supervisord_log, ns.grace)
    try:
        listener.run(EventChannel(sys.stdin.fileno(), sys.stdout))
    except EOFError:
        pass
    except Exception as exc:
        logger.exception("exit listener failed")
        if listener.failure is None:
            listener.stop_server(Failure("exit_listener", None, ExitCode.CRASH,
                                         f"exit listener failed: {type(exc).__name__}: {exc}"))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
