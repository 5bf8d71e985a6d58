"""supervisord event listener: when a program of the server exits or goes FATAL, stop the server.

It classifies each exit with `shoal.lifecycle.classify_exit` and lets `FirstFailure` decide which
one ends the server (as `shoal serve` does), then

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
import contextlib
import logging
import os
import re
import select
import signal
import sys
import time
from pathlib import Path

import psutil

from shoal.lifecycle import (
    SUPERVISORD_FATAL,
    ExitCode,
    FirstFailure,
    Reason,
    Termination,
    classify_exit,
    write_termination_message,
)

logger = logging.getLogger("shoal.exit_listener")

EXIT_STATUS_WAIT_S = 2.0  # how long to look for supervisord's log line of an exit
LOG_TAIL_BYTES = 256 * 1024
_EXITED = re.compile(r"exited: (?P<name>\S+) \((?:exit status (?P<code>\d+)"
                     r"|terminated by (?P<signal>SIG[A-Z0-9]+))")


def exit_status_from_log(log_text: str, name: str) -> int | str | None:
    """The last recorded exit of `name` in supervisord's log: an exit code or a signal name."""
    status: int | str | None = None
    for match in _EXITED.finditer(log_text):
        if match["name"] == name:
            status = int(match["code"]) if match["code"] is not None else match["signal"]
    return status


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
        self.first = FirstFailure()
        self.failure: Termination | None = None

    def run(self, channel: EventChannel) -> None:
        while True:
            event = channel.next_event(None if self.failure else
                                       self.first.seconds_left(time.monotonic()))
            failure = None
            if event is None:
                failure = self.first.on_tick(time.monotonic())
            else:
                header, payload = event
                channel.ok()
                if self.failure is None:
                    failure = self.on_event(header["eventname"], parse_tokens(payload))
            if failure is not None and self.failure is None:
                self.failure = failure
                self.stop_server(failure)

    def on_event(self, eventname: str, payload: dict[str, str]) -> Termination | None:
        name = payload.get("processname", "")
        if name not in self.ranks:
            return None
        if eventname == "PROCESS_STATE_RUNNING":
            self.pids[name] = int(payload["pid"])
            return None
        if eventname == "PROCESS_STATE_FATAL":
            failure = classify_exit(None, component=name, rank=self.ranks[name],
                                    platform_reason=SUPERVISORD_FATAL)
            return self.first.on_end(failure, time.monotonic())
        if eventname == "PROCESS_STATE_EXITED":
            self.pids.pop(name, None)
            failure = classify_exit(self._exit_status(name), component=name,
                                    rank=self.ranks[name])
            logger.error("%s exited: %s", name, failure.detail)
            return self.first.on_end(failure, time.monotonic())
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

    def stop_server(self, failure: Termination) -> None:
        logger.error("%s failed (exit code %d): stopping the server", failure.component,
                     failure.exit_code)
        write_termination_message(failure)
        staging = self.record.with_suffix(".tmp")
        staging.write_text(failure.to_json() + "\n")
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
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)  # supervisord makes every program a process group leader


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
            listener.stop_server(Termination(Reason.CRASH, "exit_listener", None, ExitCode.CRASH,
                                             f"exit listener failed: {type(exc).__name__}: {exc}"))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
