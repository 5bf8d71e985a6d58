"""One container of a pod: its runs (each a sandbox.py process tree), probes, restarts with
back-off, and the status a kubelet reports for it."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.kube.kubelet import layout, sandbox
from tests.support.kube.kubelet.cpu_limit import cpu_limit_cores, create_cgroup, remove_cgroup
from tests.support.kube.kubelet.environment import ContainerConfigError
from tests.support.kube.kubelet.probes import Prober, ProbeTarget
from tests.support.kube.kubelet.timestamps import rfc3339

logger = logging.getLogger("kubelet.container")

SANDBOX = Path(sandbox.__file__)
MAX_MESSAGE_BYTES = 4096
FALLBACK_LOG_LINES, FALLBACK_LOG_BYTES = 80, 2048
PID_WAIT_S = 30.0
CONFIG_RETRY_S = 1.0


@dataclass(frozen=True)
class Backoff:
    """Restart delays: initial, doubled per crash up to max_s; reset after a run of reset_s.
    (1 s to 60 s, the kubelet's ReduceDefaultCrashLoopBackOffDecay values.)"""
    initial_s: float = 1.0
    max_s: float = 60.0
    reset_s: float = 600.0

    def delay(self, previous: float, run_s: float) -> float:
        if run_s >= self.reset_s or previous == 0:
            return self.initial_s
        return min(previous * 2, self.max_s)


@dataclass(frozen=True)
class RunSpec:
    """Everything one run of a container needs, computed by the pod just before it starts."""
    argv: list[str]
    env: dict[str, str]
    cwd: str
    hostname: str
    binds: list[dict[str, Any]]
    pod_ip: str
    ports: dict[str, int]
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> probe
    read_only_root: bool = False  # securityContext.readOnlyRootFilesystem


def should_restart(restart_policy: str, exit_code: int, is_init: bool) -> bool:
    if is_init or restart_policy == "OnFailure":
        return exit_code != 0 and restart_policy != "Never"
    return restart_policy == "Always"


def termination_message(message_file: Path, log: Path, policy: str, exit_code: int) -> str:
    message = message_file.read_bytes()[:MAX_MESSAGE_BYTES].decode(errors="replace") \
        if message_file.exists() else ""
    if not message.strip() and policy == "FallbackToLogsOnError" and exit_code != 0:
        lines = log.read_bytes().splitlines()[-FALLBACK_LOG_LINES:] if log.exists() else []
        message = b"\n".join(lines)[-FALLBACK_LOG_BYTES:].decode(errors="replace")
    return message


class ContainerRunner:
    def __init__(self, container: dict[str, Any], *, directory: Path, restart_policy: str,
                 is_init: bool, prepare: Callable[[], RunSpec], on_change: Callable[[], None],
                 record_event: Callable[[str, str, str], None], grace_s: Callable[[], float],
                 backoff: Backoff) -> None:
        self.container, self.name = container, container["name"]
        self.directory, self.restart_policy, self.is_init = directory, restart_policy, is_init
        self._prepare, self._on_change, self._event = prepare, on_change, record_event
        self._grace_s, self._backoff = grace_s, backoff
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._probers: list[Prober] = []
        self._after_startup: list[Prober] = []  # readiness and liveness wait for startup
        self._runs = 0
        self._state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        self._last_state: dict[str, Any] = {}
        self._ready = self._started = False
        self._container_id = ""
        self._thread = threading.Thread(target=self._run, name=f"container-{self.name}",
                                        daemon=True)
        directory.mkdir(parents=True, exist_ok=True)

    # the pod's view -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def exit_code(self) -> int | None:
        with self._lock:
            return self._state.get("terminated", {}).get("exitCode")

    def request_stop(self) -> None:
        """Stop for good: SIGTERM to the running container (the pod is being deleted)."""
        self._stopping.set()
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._stopping.set()
        self._signal(signal.SIGKILL)

    def status(self) -> dict[str, Any]:
        with self._lock:
            status = {"name": self.name, "image": self.container.get("image", ""),
                      "imageID": self.container.get("image", ""), "ready": self._ready,
                      "restartCount": max(self._runs - 1, 0), "started": self._started,
                      "state": self._state}
            if self._last_state:
                status["lastState"] = self._last_state
            if self._container_id:
                status["containerID"] = self._container_id
            return status

    # the runs ---------------------------------------------------------------------------------
    def _set(self, **changes: Any) -> None:
        with self._lock:
            for key, value in changes.items():
                setattr(self, f"_{key}", value)
        self._on_change()

    def _signal(self, signum: int) -> None:
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signum)

    def _run(self) -> None:
        delay = 0.0
        while not self._stopping.is_set():
            try:
                spec = self._prepare()
                cores = cpu_limit_cores(self.container)
                cgroup = create_cgroup(cores) if cores is not None else None
            except (ContainerConfigError, OSError) as e:
                self._set(state={"waiting": {"reason": "CreateContainerConfigError",
                                             "message": str(e)}})
                self._stopping.wait(CONFIG_RETRY_S)
                continue
            started = time.time()
            try:
                exit_code, terminated = self._run_once(spec, cgroup)
            finally:
                if cgroup is not None:
                    remove_cgroup(cgroup)
            run_s = time.time() - started
            if self._stopping.is_set() or not should_restart(self.restart_policy, exit_code,
                                                              self.is_init):
                return
            delay = self._backoff.delay(delay, run_s)
            message = f"back-off {delay:g}s restarting failed container={self.name}"
            self._event("BackOff", message, "Warning")
            self._set(state={"waiting": {"reason": "CrashLoopBackOff", "message": message}},
                      last_state={"terminated": terminated})
            self._stopping.wait(delay)

    def _run_once(self, spec: RunSpec, cgroup: Path | None) -> tuple[int, dict[str, Any]]:
        log = layout.run_log(self.directory, self._runs)
        message_file = self.directory / layout.TERMINATION_LOG
        start_error = self.directory / "start-error"
        pid_file = self.directory / layout.PID_FILE
        for stale in (start_error, pid_file):
            stale.unlink(missing_ok=True)
        message_file.write_bytes(b"")
        message_path = self.container.get("terminationMessagePath", "/dev/termination-log")
        sandbox_spec = {
            "hostname": spec.hostname, "argv": spec.argv, "env": spec.env, "cwd": spec.cwd,
            "dev_staging": str(self.directory / "dev"), "pid_file": str(pid_file),
            "kubelet_pid": os.getpid(), "read_only_root": spec.read_only_root,
            "start_error_file": str(start_error),
            "cgroup_procs": str(cgroup / "cgroup.procs") if cgroup is not None else None,
            "binds": [*spec.binds, {"source": str(message_file), "target": message_path}]}
        spec_file = self.directory / "sandbox.json"
        spec_file.write_text(json.dumps(sandbox_spec, indent=1))
        with open(log, "ab") as out, self._lock:
            self._proc = subprocess.Popen(
                [sys.executable, "-S", str(SANDBOX), str(spec_file)], stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, env={}, start_new_session=True)
            self._runs += 1
            proc = self._proc
        started_at = rfc3339()
        if self._stopping.is_set():  # a stop that came while it was being created
            proc.send_signal(signal.SIGTERM)
        pid1 = self._wait_for_pid(pid_file, proc)
        self._event("Started", f"Started container {self.name}", "Normal")
        self._set(state={"running": {"startedAt": started_at}},
                  container_id=f"process://{pid1 or proc.pid}",
                  started="startupProbe" not in self.container,
                  ready="readinessProbe" not in self.container)
        if pid1 is not None:
            self._start_probers(spec, pid1)
        exit_code = proc.wait()
        exit_code = exit_code if exit_code >= 0 else 128 - exit_code
        self._stop_probers()
        terminated: dict[str, Any] = {
            "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": started_at, "finishedAt": rfc3339(), "containerID": self._container_id}
        if start_error.exists() and (error := start_error.read_text()):
            terminated.update(reason="StartError", message=error)
        elif message := termination_message(
                message_file, log, self.container.get("terminationMessagePolicy", "File"),
                exit_code):
            terminated["message"] = message
        logger.info("container %s exited with %d (%s)", self.name, exit_code,
                    terminated["reason"])
        self._set(state={"terminated": terminated}, ready=False, proc=None)
        return exit_code, terminated

    def _wait_for_pid(self, pid_file: Path, proc: subprocess.Popen[bytes]) -> int | None:
        deadline = time.monotonic() + PID_WAIT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if pid_file.exists() and (text := pid_file.read_text().strip()):
                return int(text)
            time.sleep(0.01)
        return None

    def _start_probers(self, spec: RunSpec, pid1: int) -> None:
        """This run's probers; their results count only while this run lasts."""
        target = ProbeTarget(pod_ip=spec.pod_ip, ports=spec.ports, env=spec.env,
                             exec_prefix=("nsenter", "-t", str(pid1), "-m", "-u", "-p", "--"))
        report = functools.partial(self._on_probe, self._runs)
        probers = {kind: Prober(kind, probe, target, report) for kind, probe in spec.probes.items()}
        startup = probers.pop("startup", None)
        with self._lock:
            self._probers = [startup] if startup else list(probers.values())
            self._after_startup = list(probers.values()) if startup else []
            for prober in self._probers:
                prober.start()

    def _stop_probers(self) -> None:
        with self._lock:
            probers, self._probers, self._after_startup = self._probers, [], []
        for prober in probers:
            prober.stop()

    def _on_probe(self, run: int, kind: str, ok: bool, message: str) -> None:
        with self._lock:
            if run != self._runs or self._proc is None:
                return  # a result about a run that has ended
        if kind == "readiness":
            self._set(ready=ok)
        elif kind == "startup" and ok:
            self._set(started=True)
            with self._lock:
                for prober in self._after_startup:
                    self._probers.append(prober.start())
        else:
            self._event("Unhealthy", f"{kind.capitalize()} probe failed: {message}", "Warning")
            self._restart_run(f"Container {self.name} failed {kind} probe, will be restarted")

    def _restart_run(self, why: str) -> None:
        """SIGTERM the current run; SIGKILL it after the grace period if it is still there."""
        with self._lock:
            proc = self._proc
        if proc is None:
            return
        self._event("Killing", why, "Normal")
        proc.send_signal(signal.SIGTERM)
        killer = threading.Timer(self._grace_s(), lambda: proc.poll() is None and proc.kill())
        killer.daemon = True
        killer.start()
