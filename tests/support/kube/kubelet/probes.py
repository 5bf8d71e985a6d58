"""Startup, readiness and liveness probes (httpGet, tcpSocket, exec) with the kubelet's timing:
initialDelaySeconds, periodSeconds, timeoutSeconds, successThreshold, failureThreshold."""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

logger = logging.getLogger("kubelet.probes")


@dataclass(frozen=True)
class ProbeTarget:
    """What a probe of one container run reaches: the pod's address and the run's PID 1."""
    pod_ip: str
    ports: dict[str, int]  # named container ports
    exec_prefix: tuple[str, ...]  # enters the run's namespaces (nsenter ...)
    env: dict[str, str]


def _port(port: int | str, target: ProbeTarget) -> int:
    return target.ports[port] if isinstance(port, str) and not port.isdigit() else int(port)


def probe_once(probe: dict[str, Any], target: ProbeTarget) -> tuple[bool, str]:
    """Run `probe` once: (succeeded, why not)."""
    timeout = probe.get("timeoutSeconds", 1)
    try:
        if "httpGet" in probe:
            get = probe["httpGet"]
            url = (f"{get.get('scheme', 'HTTP').lower()}://{get.get('host') or target.pod_ip}:"
                   f"{_port(get['port'], target)}{get.get('path', '/')}")
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            status = httpx.get(url, headers=headers, timeout=timeout, verify=False,
                               follow_redirects=True).status_code
            return 200 <= status < 400, f"HTTP probe failed with statuscode: {status}"
        if "tcpSocket" in probe:
            tcp = probe["tcpSocket"]
            with socket.create_connection(
                    (tcp.get("host") or target.pod_ip, _port(tcp["port"], target)), timeout):
                return True, ""
        if "exec" in probe:
            done = subprocess.run([*target.exec_prefix, *probe["exec"]["command"]],
                                  env=target.env, capture_output=True, timeout=timeout,
                                  check=False)
            output = (done.stdout + done.stderr).decode(errors="replace")[-1024:]
            return done.returncode == 0, f"exec probe exited {done.returncode}: {output}"
    except (OSError, httpx.HTTPError, subprocess.TimeoutExpired, KeyError) as e:
        return False, f"{type(e).__name__}: {e}"
    return False, f"probe handler {sorted(probe)} is not emulated by the process kubelet"


class Prober:
    """Probes one container run on a thread until stopped; reports each change of the result.

    `on_result(kind, ok, message)`: readiness reports every flip (initially not ready);
    startup reports its first success or the failure that ends the run; liveness reports only
    the failure that should restart the container."""

    def __init__(self, kind: str, probe: dict[str, Any], target: ProbeTarget,
                 on_result: Callable[[str, bool, str], None]) -> None:
        self.kind, self.probe, self.target, self.on_result = kind, probe, target, on_result
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"probe-{kind}", daemon=True)

    def start(self) -> Prober:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        period = self.probe.get("periodSeconds", 10)
        need_success = self.probe.get("successThreshold", 1)
        need_failure = self.probe.get("failureThreshold", 3)
        successes = failures = 0
        ok: bool | None = None
        if self._stopped.wait(self.probe.get("initialDelaySeconds", 0)):
            return
        while not self._stopped.is_set():
            passed, why = probe_once(self.probe, self.target)
            if self._stopped.is_set():
                return
            successes, failures = (successes + 1, 0) if passed else (0, failures + 1)
            if successes >= need_success and ok is not True:
                ok = True
                if self.kind != "liveness":
                    self.on_result(self.kind, True, "")
                if self.kind == "startup":
                    return
            elif failures >= need_failure and ok is not False:
                ok = False
                logger.info("%s probe failed: %s", self.kind, why)
                self.on_result(self.kind, False, why)
                if self.kind != "readiness":
                    return
            self._stopped.wait(period)
