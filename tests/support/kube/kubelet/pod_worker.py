"""One pod on the process kubelet, from binding to deletion, on a thread of its own.

setup (folder, pod IP, hosts file, volumes) -> init containers one after another -> the
containers, each a ContainerRunner -> status written whenever it changes -> on deletion:
SIGTERM to every container, SIGKILL after the grace period, then the pod object is deleted
with grace 0, as a kubelet does.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.dynamic.exceptions import DynamicApiError, NotFoundError

from tests.support.kube.kubelet import dns, layout
from tests.support.kube.kubelet.addresses import PodAddresses
from tests.support.kube.kubelet.api import KubeApi
from tests.support.kube.kubelet.container import Backoff, ContainerRunner, RunSpec
from tests.support.kube.kubelet.environment import (
    ContainerConfigError,
    PodNetwork,
    container_argv,
    container_env,
)
from tests.support.kube.kubelet.image import HostPaths, ImageConfig
from tests.support.kube.kubelet.pod_status import pod_status
from tests.support.kube.kubelet.timestamps import rfc3339
from tests.support.kube.kubelet.volumes import prepare_volumes, volume_binds

logger = logging.getLogger("kubelet.pod")

DEFAULT_GRACE_S = 30.0
FORCED_STOP_GRACE_S = 2.0
VOLUME_RETRY_S = 1.0
PROBES = {"startup": "startupProbe", "readiness": "readinessProbe", "liveness": "livenessProbe"}


@dataclass
class PodContext:
    """What every pod worker shares: the API, the node, the image, the cluster's DNS."""
    api: KubeApi
    root: Path
    node_name: str
    host_ip: str
    addresses: PodAddresses
    image: ImageConfig
    paths: HostPaths
    backoff: Backoff
    records: Callable[[], dns.Records]
    services: Callable[[str], list[dict[str, Any]]]  # namespace -> its Services


def rewrite_in_place(path: Path, text: str) -> None:
    """Replace a file's content keeping its inode (a bind mount pins the inode)."""
    with open(path, "r+") as f:
        if f.read() == text:
            return
        f.seek(0)
        f.write(text)
        f.truncate()


class PodWorker:
    def __init__(self, pod: dict[str, Any], ctx: PodContext) -> None:
        self.ctx = ctx
        self.uid, self.key = pod["metadata"]["uid"], _key(pod)
        self._pod = pod
        self._lock = threading.Lock()
        self._hosts_lock = threading.Lock()
        self._changed = threading.Event()
        self._stopping = threading.Event()
        self._stop_reason = ""  # deleted (graceful), gone (the object is), shutdown (kubelet's)
        meta = pod["metadata"]
        self.directory = layout.pod_dir(ctx.root, meta["namespace"], meta["name"])
        self.pod_ip = ""
        self._start_time = ""
        self._volumes: dict[str, Path] = {}
        self._init_runners: list[ContainerRunner] = []
        self._runners: list[ContainerRunner] = []
        self._initialized = False
        self._written: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name=f"pod-{self.key}", daemon=True)

    # the kubelet's view -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def finished(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def update(self, pod: dict[str, Any]) -> None:
        with self._lock:
            self._pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self._stop("deleted")
        self._changed.set()

    def force_stop(self) -> None:
        """The pod object is gone (deleted with grace 0): stop at once."""
        self._stop("gone")

    def shutdown(self) -> None:
        """The kubelet stops: stop the containers at once, leave the pod object as it is."""
        self._stop("shutdown")

    def _stop(self, reason: str) -> None:
        with self._lock:
            if not self._stop_reason:
                self._stop_reason = reason
        self._stopping.set()
        self._changed.set()

    def update_hosts(self, records: dns.Records) -> None:
        hosts = self.directory / "hosts"
        with self._hosts_lock:
            if self.pod_ip and hosts.exists():
                rewrite_in_place(hosts, dns.hosts_file(self.pod, self.pod_ip, records))

    @property
    def pod(self) -> dict[str, Any]:
        with self._lock:
            return self._pod

    # the pod's life ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._set_up()
            if self._prepare_volumes() and self._run_init_containers():
                self._start_containers()
            while not self._stopping.is_set():
                self._publish_when_changed()
            deleted = self._stop_reason == "deleted"
            self._stop_containers(self._grace_s() if deleted else FORCED_STOP_GRACE_S)
            if deleted:
                self._publish()
                self.ctx.api.delete_pod_now(self.pod)
        except Exception:
            logger.exception("pod %s: the process kubelet failed", self.key)
            self._stop_containers(FORCED_STOP_GRACE_S)
        finally:
            if self.pod_ip:
                self.ctx.addresses.release(self.pod_ip)
        logger.info("pod %s: done (%s)", self.key, self._stop_reason or "failed")

    def _set_up(self) -> None:
        meta = self.pod["metadata"]
        uid_file = self.directory / "uid"
        if uid_file.exists() and uid_file.read_text() != self.uid:
            shutil.move(self.directory, layout.retired_pod_dir(
                self.ctx.root, meta["namespace"], meta["name"], uid_file.read_text()))
        self.directory.mkdir(parents=True, exist_ok=True)
        uid_file.write_text(self.uid)
        self._start_time = rfc3339()
        (self.directory / "hostname").write_text(dns.pod_hostname(self.pod) + "\n")
        with self._hosts_lock:
            self.pod_ip = self.ctx.addresses.allocate()
            (self.directory / "hosts").write_text(
                dns.hosts_file(self.pod, self.pod_ip, self.ctx.records()))
        logger.info("pod %s: IP %s, folder %s", self.key, self.pod_ip, self.directory)
        self._publish()

    def _prepare_volumes(self) -> bool:
        network = self._network()
        while not self._stopping.is_set():
            try:
                self._volumes = prepare_volumes(self.ctx.api, self.pod,
                                                self.directory / "volumes", network)
                return True
            except (ContainerConfigError, DynamicApiError) as e:
                message = str(e) if isinstance(e, ContainerConfigError) else e.summary()
                logger.info("pod %s: volumes not ready: %s", self.key, message)
                self._event("FailedMount", message, "Warning")
                self._stopping.wait(VOLUME_RETRY_S)
        return False

    def _run_init_containers(self) -> bool:
        for container in self.pod["spec"].get("initContainers") or []:
            runner = self._runner(container, is_init=True)
            self._init_runners.append(runner)
            runner.start()
            while not runner.done() and not self._stopping.is_set():
                self._publish_when_changed()
            if runner.exit_code() != 0:
                return False
        self._initialized = True
        return True

    def _start_containers(self) -> None:
        self._runners = [self._runner(c, is_init=False) for c in self.pod["spec"]["containers"]]
        for runner in self._runners:
            runner.start()

    def _publish_when_changed(self) -> None:
        self._changed.wait(1.0)
        self._changed.clear()
        self._publish()

    def _stop_containers(self, grace_s: float) -> None:
        runners = self._init_runners + self._runners
        if any(not r.done() for r in runners):
            self._event("Killing", f"Stopping the pod's containers (grace {grace_s:g} s)",
                        "Normal")
        for runner in runners:
            runner.request_stop()
        deadline = time.monotonic() + grace_s
        for runner in runners:
            runner.join(max(deadline - time.monotonic(), 0))
        for runner in runners:
            if not runner.done():
                runner.kill()
                runner.join()

    # containers -------------------------------------------------------------------------------
    def _runner(self, container: dict[str, Any], is_init: bool) -> ContainerRunner:
        return ContainerRunner(
            container, directory=layout.container_dir(self.directory, container["name"]),
            restart_policy=self.pod["spec"].get("restartPolicy", "Always"), is_init=is_init,
            prepare=lambda: self._run_spec(container), on_change=self._changed.set,
            record_event=self._event, grace_s=self._grace_s, backoff=self.ctx.backoff)

    def _run_spec(self, container: dict[str, Any]) -> RunSpec:
        pod, image, paths = self.pod, self.ctx.image, self.ctx.paths
        env = container_env(pod, container, image=image, paths=paths, home=str(Path.home()),
                            network=self._network(),
                            services=self.ctx.services(pod["metadata"]["namespace"]),
                            lookup=self._lookup)
        cwd = container.get("workingDir")
        if cwd:
            Path(cwd).mkdir(parents=True, exist_ok=True)
        else:
            cwd = image.workdir if Path(image.workdir).is_dir() else str(self.directory)
        probes = {kind: _mapped_probe(container[field], paths) for kind, field in PROBES.items()
                  if container.get(field)}
        return RunSpec(
            argv=container_argv(container, image, paths, env), env=env, cwd=cwd,
            hostname=dns.pod_hostname(pod), pod_ip=self.pod_ip, probes=probes,
            binds=[{"source": str(self.directory / "hosts"), "target": "/etc/hosts"},
                   {"source": str(self.directory / "hostname"), "target": "/etc/hostname"},
                   *volume_binds(container, self._volumes)],
            ports={p["name"]: p["containerPort"] for p in container.get("ports") or []
                   if p.get("name")},
            read_only_root=bool((container.get("securityContext") or {}).get(
                "readOnlyRootFilesystem")))

    def _lookup(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.ctx.api.get(kind, namespace, name)
        except DynamicApiError as e:
            raise ContainerConfigError(e.summary()) from e

    # status -----------------------------------------------------------------------------------
    def _publish(self) -> None:
        """Write the pod's status if it changed since the last write."""
        init_statuses = [r.status() for r in self._init_runners]
        init_failed = (self.pod["spec"].get("restartPolicy") == "Never" and any(
            r.done() and r.exit_code() not in (None, 0) for r in self._init_runners))
        status = pod_status(
            restart_policy=self.pod["spec"].get("restartPolicy", "Always"), pod_ip=self.pod_ip,
            host_ip=self.ctx.host_ip, start_time=self._start_time, init_statuses=init_statuses,
            container_statuses=[r.status() for r in self._runners] or self._waiting_statuses(),
            initialized=self._initialized, init_failed=init_failed,
            previous_conditions=self._written.get("conditions", []), now=rfc3339())
        if status == self._written or self._stop_reason in ("gone", "shutdown"):
            return
        try:
            self.ctx.api.patch_pod_status(self.pod, status)
        except NotFoundError:
            return
        except DynamicApiError as e:
            logger.warning("pod %s: status not written: %s", self.key, e.summary())
            return
        if status["phase"] != self._written.get("phase"):
            logger.info("pod %s: %s", self.key, status["phase"])
        self._written = status

    def _waiting_statuses(self) -> list[dict[str, Any]]:
        reason = "PodInitializing" if self.pod["spec"].get("initContainers") else \
            "ContainerCreating"
        return [{"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": False,
                 "restartCount": 0, "started": False, "state": {"waiting": {"reason": reason}}}
                for c in self.pod["spec"]["containers"]]

    # helpers ----------------------------------------------------------------------------------
    def _network(self) -> PodNetwork:
        return PodNetwork(pod_ip=self.pod_ip, host_ip=self.ctx.host_ip,
                          apiserver_port=self.ctx.api.apiserver_port)

    def _grace_s(self) -> float:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds")
        return DEFAULT_GRACE_S if grace is None else float(grace)

    def _event(self, reason: str, message: str, event_type: str) -> None:
        if self._stop_reason in ("gone", "shutdown"):
            return
        with contextlib.suppress(DynamicApiError):  # the namespace is going away, say
            self.ctx.api.record_event(self.pod, reason, message, event_type,
                                      f"kubelet/{self.ctx.node_name}", rfc3339())


def _key(pod: dict[str, Any]) -> str:
    return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"


def _mapped_probe(probe: dict[str, Any], paths: HostPaths) -> dict[str, Any]:
    if "exec" not in probe:
        return probe
    return {**probe, "exec": {"command": paths.command(list(probe["exec"]["command"]))}}
