"""The image's entrypoint: run the server's components under supervisord; exit with why it ended.

    entrypoint.py [shoal serve flags]      (every flag also from SHOAL_<FLAG>; docs/contracts.md)

1. Reads the server config from flags and the environment the operator injects; a config that
   cannot work ends here with 88 (`startup-failed`) and a termination message.
2. Renders the launch plan (the one `shoal serve` runs) as a supervisord config in a private run
   directory, and runs supervisord in the foreground, in its own session.
3. SIGTERM/SIGINT are forwarded to supervisord as SIGTERM: a graceful drain, api first (see
   shoal.launch.supervisord), then exit 0.
4. When a program fails, the exit listener records it and stops supervisord; this process then
   exits with that program's exit code (docs/contracts.md), with the termination message in place.
5. Nothing is left running: as a child subreaper (and PID 1 in a container) this process adopts
   whatever outlives supervisord, kills it and reaps it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import NoReturn

import psutil

from shoal import model_store
from shoal.config import ConfigError, ServerArgs, add_server_flags, server_args_from_namespace
from shoal.ipc.sockets import make_run_dir
from shoal.launch.node_health import serve_node_health
from shoal.launch.plan import build_plan, resolve_launch_args
from shoal.launch.supervisord import SupervisordFiles, SupervisordOptions, render_supervisord_conf
from shoal.lifecycle import (
    ExitCode,
    classify_exit,
    fail,
    parse_termination_message,
    reset_termination_log,
    set_parent_death_signal,
    termination_log_path,
    write_termination_message,
)

logger = logging.getLogger("shoal.entrypoint")

EXIT_LISTENER = Path(__file__).resolve().with_name("exit_listener.py")
POLL_S = 0.1
SWEEP_GRACE_S = 2.0
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        _startup_failed(f"bad arguments: {message}")


def _startup_failed(detail: str) -> NoReturn:
    logger.error("cannot start: %s", detail)
    fail(ExitCode.STARTUP_FAILED, "entrypoint", None, detail)


class Appliance:
    """supervisord running one server's plan, and the exit code it ended with."""

    def __init__(self, args: ServerArgs, run_dir: str) -> None:
        self.args = args
        self.files = SupervisordFiles(run_dir)
        plan = build_plan(args, run_dir)
        options = SupervisordOptions(exit_listener=(sys.executable, str(EXIT_LISTENER)))
        Path(self.files.conf).write_text(render_supervisord_conf(plan, options))
        self.supervisord: subprocess.Popen[bytes] | None = None
        self.supervisord_status: int | None = None
        self.stop_requested = False

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward_stop)
        self.supervisord = subprocess.Popen(
            [sys.executable, "-m", "supervisor.supervisord", "--nodaemon",
             "--configuration", self.files.conf],
            start_new_session=True,  # a terminal's Ctrl-C reaches only this process
            preexec_fn=_terminate_with_parent)  # noqa: PLW1509 - no thread runs yet
        logger.info("supervisord started (pid %d), config %s", self.supervisord.pid,
                    self.files.conf)
        if self.stop_requested:  # a stop that came before supervisord existed
            self._signal_supervisord()
        if self.args.node_rank > 0:
            serve_node_health(self.args.host, self.args.port, self._is_healthy)
        self._wait_for_supervisord()
        _kill_leftovers()
        return self._exit_code()

    def _forward_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requested = True
        logger.info("%s: stopping the server (drain first)", signal.Signals(signum).name)
        self._signal_supervisord()

    def _signal_supervisord(self) -> None:
        # NOTE: not Popen.send_signal, which polls and could reap supervisord behind the
        # waitpid loop below
        if self.supervisord is not None and self.supervisord_status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.supervisord.pid, signal.SIGTERM)

    def _is_healthy(self) -> bool:
        return self.supervisord_status is None and not Path(self.files.exit_record).exists()

    def _wait_for_supervisord(self) -> None:
        assert self.supervisord is not None
        while self.supervisord_status is None:
            for pid, status in _reap():
                if pid == self.supervisord.pid:
                    self.supervisord_status = os.waitstatus_to_exitcode(status)
            time.sleep(POLL_S)
        self.supervisord.returncode = self.supervisord_status

    def _exit_code(self) -> int:
        record = Path(self.files.exit_record)
        failure = parse_termination_message(record.read_text()) if record.exists() else None
        if failure is None:
            failure = classify_exit(self.supervisord_status, component="supervisord",
                                    expected=True)
            if failure.exit_code == ExitCode.COMPLETED:
                logger.info("server stopped cleanly")
                return ExitCode.COMPLETED
        # a no-op when the listener (or the component itself) already wrote it
        write_termination_message(failure)
        logger.error("server stopped: %s (exit code %d)", failure.detail, failure.exit_code)
        return failure.exit_code


def _terminate_with_parent() -> None:
    """In supervisord's child before exec: a SIGTERM (a clean shutdown) if this process dies."""
    set_parent_death_signal(signal.SIGTERM)


def _reap() -> list[tuple[int, int]]:
    """Reap every exited child (supervisord, or an orphan adopted as subreaper / PID 1)."""
    reaped = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append((pid, status))


def _kill_leftovers() -> None:
    """Whatever outlived supervisord was re-parented here: TERM, then KILL, then reap."""
    leftovers = psutil.Process().children(recursive=True)
    if not leftovers:
        return
    logger.warning("stopping %d process(es) left after supervisord: %s", len(leftovers),
                   ", ".join(str(p.pid) for p in leftovers))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in leftovers:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(sig)
        _, leftovers = psutil.wait_procs(leftovers, timeout=SWEEP_GRACE_S)
        if not leftovers:
            break
    _reap()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s [entrypoint] %(levelname)s: %(message)s")
    reset_termination_log()
    # until supervisord runs, a stop is just an exit (PID 1 ignores an unhandled SIGTERM)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_before_start)
    parser = _Parser(prog="entrypoint", description=__doc__.splitlines()[0])
    add_server_flags(parser)
    ns = parser.parse_args(argv)
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)
    try:
        args = resolve_launch_args(server_args_from_namespace(ns))
        logging.getLogger().setLevel(args.log_level.upper())
        if args.model_path is None:
            logger.info("default model at %s", model_store.prepare())
    except (ConfigError, model_store.ModelNotAvailable, OSError) as exc:
        _startup_failed(f"{type(exc).__name__}: {exc}")
    logger.info("termination log: %s", termination_log_path() or "(none)")
    run_dir = make_run_dir(tempfile.mkdtemp(prefix="shoal-"))
    try:
        return Appliance(args, run_dir).run()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _exit_before_start(signum: int, frame: FrameType | None) -> None:
    logger.info("%s before the server started: exiting", signal.Signals(signum).name)
    sys.exit(ExitCode.COMPLETED)

if __name__ == "__main__":
    sys.exit(main())
