"""The process kubelet's control loop: informers on pods, Services and EndpointSlices feed one
queue; each key is synced level-triggered from the informers' caches.

- a pending pod (no nodeName, default scheduler) is bound to this node: the scheduler's job;
- a pod bound here gets a PodWorker (one per pod UID) that runs it and writes its status;
- a Service or EndpointSlice change recomputes the cluster's DNS records and rewrites every
  pod's hosts file.
"""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from typing import Any

from kubernetes.dynamic.exceptions import ConflictError, DynamicApiError
from kubernetes.informer import ADDED, DELETED, MODIFIED, SharedInformer

from tests.support.kube.kubelet import dns
from tests.support.kube.kubelet.addresses import PodAddresses
from tests.support.kube.kubelet.api import KubeApi
from tests.support.kube.kubelet.container import Backoff
from tests.support.kube.kubelet.image import HostPaths, ImageConfig
from tests.support.kube.kubelet.node import DEFAULT_SCHEDULER, node_labels, unschedulable_reason
from tests.support.kube.kubelet.pod_worker import PodContext, PodWorker
from tests.support.kube.kubelet.timestamps import rfc3339

logger = logging.getLogger("kubelet")

DNS_KEY = "<dns>"
SHUTDOWN_JOIN_S = 15.0


class Kubelet:
    def __init__(self, api: KubeApi, *, root: Path, node_name: str, host_ip: str,
                 addresses: PodAddresses, image: ImageConfig, paths: HostPaths,
                 backoff: Backoff) -> None:
        self.api = api
        self.ctx = PodContext(api=api, root=root, node_name=node_name, host_ip=host_ip,
                              addresses=addresses, image=image, paths=paths, backoff=backoff,
                              records=self.records, services=self.services)
        self.labels = node_labels(node_name)
        core, discovery = api.core, api.discovery
        self._pods = SharedInformer(core.list_pod_for_all_namespaces)
        self._services = SharedInformer(core.list_service_for_all_namespaces)
        self._slices = SharedInformer(discovery.list_endpoint_slice_for_all_namespaces)
        self._queue: queue.Queue[str] = queue.Queue()
        self._workers: dict[str, PodWorker] = {}  # by pod UID
        self._records: dns.Records = {}
        self._records_lock = threading.Lock()
        self._unschedulable: set[str] = set()

    def records(self) -> dns.Records:
        with self._records_lock:
            return self._records

    def services(self, namespace: str) -> list[dict[str, Any]]:
        return [self.api.to_dict(s) for s in self._services.cache.list()
                if s.metadata.namespace == namespace]

    def run(self, stop: threading.Event) -> None:
        for informer, key in ((self._pods, None), (self._services, DNS_KEY),
                              (self._slices, DNS_KEY)):
            for event in (ADDED, MODIFIED, DELETED):
                informer.add_event_handler(event, self._enqueue(key))
            informer.start()
        while not stop.is_set():
            try:
                key = self._queue.get(timeout=1.0)
            except queue.Empty:
                self._forget_finished()
                continue
            try:
                self._sync_dns() if key == DNS_KEY else self._sync_pod(key)
            except DynamicApiError as e:
                logger.warning("sync %s: %s", key, e.summary())
        self._shut_down()

    def _enqueue(self, fixed_key: str | None) -> Any:
        def handler(obj: Any) -> None:
            self._queue.put(fixed_key or f"{obj.metadata.namespace}/{obj.metadata.name}")
        return handler

    # pods -------------------------------------------------------------------------------------
    def _sync_pod(self, key: str) -> None:
        model = self._pods.cache.get_by_key(key)
        pod = self.api.to_dict(model) if model is not None else None
        uid = pod["metadata"]["uid"] if pod else None
        for worker in list(self._workers.values()):
            if worker.key == key and worker.uid != uid:
                worker.force_stop()
        if pod is None:
            return
        node_name = pod["spec"].get("nodeName")
        if not node_name:
            self._schedule(pod)
        elif node_name == self.ctx.node_name:
            self._run_pod(pod)

    def _schedule(self, pod: dict[str, Any]) -> None:
        if pod["metadata"].get("deletionTimestamp") or pod["spec"].get(
                "schedulerName", DEFAULT_SCHEDULER) != DEFAULT_SCHEDULER:
            return
        key, uid = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}", \
            pod["metadata"]["uid"]
        reason = unschedulable_reason(pod, self.labels)
        if reason is not None:
            if uid not in self._unschedulable:
                self._unschedulable.add(uid)
                logger.info("pod %s: unschedulable: %s", key, reason)
                self.api.patch_pod_status(pod, {"phase": "Pending", "conditions": [{
                    "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": reason, "lastProbeTime": None,
                    "lastTransitionTime": rfc3339()}]})
            return
        try:
            self.api.bind(pod, self.ctx.node_name)
        except ConflictError:
            return  # bound already
        logger.info("pod %s: bound to %s", key, self.ctx.node_name)
        self.api.record_event(pod, "Scheduled", f"Successfully assigned {key} to "
                              f"{self.ctx.node_name}", "Normal", "default-scheduler", rfc3339())

    def _run_pod(self, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        worker = self._workers.get(uid)
        if worker is not None:
            worker.update(pod)
            return
        if pod["metadata"].get("deletionTimestamp"):
            self.api.delete_pod_now(pod)  # deleted before it ever ran here
            return
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            return
        worker = PodWorker(pod, self.ctx)
        self._workers[uid] = worker
        worker.start()

    def _forget_finished(self) -> None:
        for uid, worker in list(self._workers.items()):
            if worker.finished():
                del self._workers[uid]

    # DNS --------------------------------------------------------------------------------------
    def _sync_dns(self) -> None:
        records = dns.service_records([self.api.to_dict(s) for s in self._services.cache.list()],
                                      [self.api.to_dict(s) for s in self._slices.cache.list()])
        with self._records_lock:
            if records == self._records:
                return
            self._records = records
        for worker in list(self._workers.values()):
            worker.update_hosts(records)

    def _shut_down(self) -> None:
        logger.info("stopping: %d pods", len(self._workers))
        logging.getLogger("kubernetes.informer").setLevel(logging.CRITICAL)  # closed watches
        for informer in (self._pods, self._services, self._slices):
            informer.stop()
        for worker in self._workers.values():
            worker.shutdown()
        for worker in self._workers.values():
            worker.join(SHUTDOWN_JOIN_S)
