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

from shoal.launch.plan import ComponentSpec, LaunchPlan
from shoal.lifecycle import ExitCode, reset_termination_log, write_termination_message

logger = logging.getLogger(__name__)

POLL_S = 0.1
GRACE_S = 5.0
DRAIN_TIMEOUT_S = 120.0  # a clean stop lets the api finish in-flight requests this long
PEER_LOST_GRACE_S = 2.0  # how long a peer-lost exit waits for the failure that caused it


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
        """The exit code of the component that failed first. A rank that exits `peer-lost` is a
        consequence, so the failure that caused it (often seen a moment later) is preferred."""
        first_peer_lost_at: float | None = None
        while not self._stop_requested:
            exited = [(spec, code) for spec in self.plan.components
                      if (code := self.procs[spec.name].poll()) is not None]
            primary = [(spec, code) for spec, code in exited if code != ExitCode.PEER_LOST]
            if primary:
                return self._on_component_exit(*primary[0])
            if exited:
                first_peer_lost_at = first_peer_lost_at or time.monotonic()
                if time.monotonic() - first_peer_lost_at > PEER_LOST_GRACE_S:
                    return self._on_component_exit(*exited[0])
            time.sleep(POLL_S)
        logger.info("stop requested: shutting the server down")
        return ExitCode.COMPLETED

    def _on_component_exit(self, spec: ComponentSpec, code: int) -> int:
        if code < 0:
            detail = f"{spec.title} killed by {signal.Signals(-code).name}"
            code = 128 - code
        elif code == 0:
            detail, code = f"{spec.title} exited unexpectedly", ExitCode.CRASH
        else:
            detail = f"{spec.title} exited with {code}"
        # a no-op when the component wrote its own message before exiting
        write_termination_message(code, spec.name, spec.rank, detail)
        logger.error("%s exited with code %d: stopping the server", spec.title, code)
        return code

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
                    return self._on_component_exit(spec, code)
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
