"""The real test cluster for the Kubernetes tests: one per session, a fresh namespace per test.

    kube_cluster  (session)   etcd + kube-apiserver + kube-controller-manager + process kubelet
    kubelet       (session)   KubeletHandle: the pods' folders, logs and processes
    namespace     (function)  a new namespace; deleted after the test, waiting until its pods
                              and their processes are gone (not for the rest of its objects)
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import kubernetes
import pytest

from tests.support.kube.cluster import KubeCluster, RunningCluster, chart_crds, start_cluster
from tests.support.kube.kubelet_handle import KubeletHandle
from tests.support.wait import wait_until

NAMESPACE_READY_S = 30.0
PODS_GONE_S = 120.0


@pytest.fixture(scope="session")
def running_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    running = start_cluster(tmp_path_factory.mktemp("kube"), chart_crds())
    yield running
    running.stop()
    leftovers = running.kubelet.all_pod_processes()
    for process in leftovers:
        process.kill()
    assert not leftovers, f"pod processes outlived the process kubelet: {leftovers}"


@pytest.fixture(scope="session")
def kube_cluster(running_cluster: RunningCluster) -> KubeCluster:
    return running_cluster.cluster


@pytest.fixture(scope="session")
def kubelet(running_cluster: RunningCluster) -> KubeletHandle:
    return running_cluster.kubelet


@pytest.fixture
def namespace(request: pytest.FixtureRequest, running_cluster: RunningCluster) -> Iterator[str]:
    core = kubernetes.client.CoreV1Api(running_cluster.cluster.api_client())
    name = f"{re.sub(r'[^a-z0-9]+', '-', request.node.name.lower())[:40].strip('-')}-" \
           f"{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    wait_until(lambda: any(sa.metadata.name == "default" for sa in
                           core.list_namespaced_service_account(name).items),
               NAMESPACE_READY_S, what=f"no default ServiceAccount in {name}")
    yield name
    running_cluster.check_running()
    core.delete_namespace(name)  # Terminating: nothing creates pods in it any more
    core.delete_collection_namespaced_pod(name)  # sooner than the namespace controller would
    wait_until(lambda: not core.list_namespaced_pod(name).items, PODS_GONE_S,
               what=f"pods of namespace {name} still there")
    wait_until(lambda: not running_cluster.kubelet.namespace_processes(name),
               PODS_GONE_S, what=f"processes of {name}'s pods still running")
