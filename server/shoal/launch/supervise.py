"""`shoal serve`'s runner: start the plan's components, and end them all when one ends.

The server exits with the code of the component that failed first; a component killed by a
signal exits as 128 + signal, and the runner writes its termination message on its behalf.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

from shoal.launch.plan import LaunchPlan
from shoal.lifecycle import (
    ExitCode,
    FirstFailure,
    Termination,
    classify_exit,
    reset_termination_log,
    write_termination_message,
)

logger = logging.getLogger(__name__)

POLL_S = 0.1
GRACE_S = 5.0
DRAIN_TIMEOUT_S = 120.0  # a clean stop lets the api finish in-flight requests this long


class PlanRunner:
    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._stop_requested = False

    def run(self) -> int:
        reset_termination_log()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._request_stop)
        for spec in self.plan.components:
            self.procs[spec.name] = subprocess.Popen(spec.argv, env={**os.environ, **spec.env})
            logger.info("started %s (pid %d)", spec.title, self.procs[spec.name].pid)
        try:
            code = self._wait_for_first_exit()
            if code == ExitCode.COMPLETED:
                code = self._drain()
        finally:
            self._terminate(list(self.procs.values()), GRACE_S)
        return code

    def _request_stop(self, signum: int, frame: object) -> None:
        self._stop_requested = True

    def all_alive(self) -> bool:
        return all(proc.poll() is None for proc in self.procs.values())

    def _wait_for_first_exit(self) -> int:
        """The exit code of the component that failed first (`FirstFailure` decides)."""
        first = FirstFailure()
        seen: set[str] = set()
        while not self._stop_requested:
            for spec in self.plan.components:
                code = self.procs[spec.name].poll()
                if code is None or spec.name in seen:
                    continue
                seen.add(spec.name)
                failure = first.on_end(classify_exit(code, component=spec.name, rank=spec.rank),
                                       time.monotonic())
                if failure is not None:
                    return self._on_failure(failure)
            failure = first.on_tick(time.monotonic())
            if failure is not None:
                return self._on_failure(failure)
            time.sleep(POLL_S)
        logger.info("stop requested: shutting the server down")
        return ExitCode.COMPLETED

    @staticmethod
    def _on_failure(failure: Termination) -> int:
        # a no-op when the component wrote its own message before exiting
        write_termination_message(failure)
        logger.error("%s: stopping the server", failure.detail)
        return failure.exit_code

    def _drain(self) -> int:
        """A clean stop: the api stops accepting and finishes its in-flight requests while the
        engine keeps running; an engine component that fails meanwhile still counts."""
        api = self.procs.get("api")
        if api is None:
            return ExitCode.COMPLETED
        api.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while api.poll() is None and time.monotonic() < deadline:
            for spec in self.plan.components:
                code = self.procs[spec.name].poll()
                if spec.name != "api" and code is not None:
                    return self._on_failure(classify_exit(code, component=spec.name,
                                                          rank=spec.rank))
            time.sleep(POLL_S)
        return ExitCode.COMPLETED

    @staticmethod
    def _terminate(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
        alive = [p for p in procs if p.poll() is None]
        for proc in alive:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
