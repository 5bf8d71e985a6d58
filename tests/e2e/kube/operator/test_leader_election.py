"""Operator high availability on the real test cluster: the session's operator leads through a
coordination.k8s.io Lease and a second one stands by. A group is recreated after a fault; the
leader, which has counted the fault, is SIGKILLed before the group comes back; the standby takes
the Lease within 15 s and finishes the restart: the fault counted once, each pod created once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest

from tests.e2e.kube.operator.conftest import (
    LEASE_NAME,
    LEASE_NAMESPACE,
    Deployments,
    Operator,
)
from tests.support.kube.cluster import KubeCluster
from tests.support.wait import wait_until

NAME = "ha"
HAND_OVER_S = 15.0
GROUP_BACK_S = 600.0  # a new pod loads the model: minutes when other work loads the host
# a small KV pool; the engine's own watchdog timeout (the fault tests' 5 s is too short for a
# first request on a loaded host, and no hang is injected here)
ENGINE_ARGS = ["--max-total-tokens", "4096"]


def _holder(cluster: KubeCluster) -> str:
    """The Lease's holder identity ("" before anyone took it)."""
    try:
        lease = kubernetes.client.CoordinationV1Api(cluster.api_client()).read_namespaced_lease(
            LEASE_NAME, LEASE_NAMESPACE)
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return ""
        raise
    return lease.spec.holder_identity or ""


@pytest.fixture
def standby(kube_cluster: KubeCluster, operator: Operator, tmp_path: Path) -> Iterator[Operator]:
    """A second operator, started once the session's leads; afterwards stopped, and the
    session's operator running again (it leads once the standby has given the Lease up)."""
    wait_until(lambda: _holder(kube_cluster), 60, what="the session's operator took no Lease")
    second = Operator(kube_cluster.admin_kubeconfig, tmp_path / "standby.log")
    second.start()
    yield second
    second.stop()
    if operator.component is not None and operator.component.proc.poll() is not None:
        operator.start()


def test_the_standby_takes_over_a_group_restart_from_a_killed_leader(
        deployments: Deployments, operator: Operator, standby: Operator) -> None:
    mds = deployments
    leader = _holder(mds.cluster)
    mds.create(NAME, {"engine": {"args": ENGINE_ARGS},
                      "restartPolicy": {"backoff": {"initialSeconds": 5, "maxSeconds": 5}}})
    mds.wait_ready(NAME)
    assert _holder(mds.cluster) == leader  # the standby never took it while the leader lived
    assert "leading as" not in standby.log_path.read_text()
    old = mds.pod_uids(NAME)

    mds.rank_process(f"{NAME}-0-0", "shoal::scheduler_TP0").kill()
    wait_until(lambda: mds.status(NAME)["groups"][0]["phase"] == "Restarting", 60,
               interval=0.1, what="group not Restarting")
    operator.kill()  # the leader counted the fault; the group waits out its backoff
    killed = time.monotonic()
    counted = mds.status(NAME)
    assert counted["restartsByReason"] == {"crash": 1}

    new_leader = wait_until(lambda: (lambda h: h if h and h != leader else None)(
        _holder(mds.cluster)), HAND_OVER_S, interval=0.2, what="the standby took no Lease")
    assert time.monotonic() - killed <= HAND_OVER_S
    assert f"leading as {new_leader}" in standby.log_path.read_text()

    seen: dict[str, str] = {}

    def group_back() -> bool:  # records every pod that appears until the group is back
        pods = mds.pods(NAME)
        seen.update({p.metadata.uid: p.metadata.name for p in pods})
        live = [p for p in pods if not p.metadata.deletion_timestamp]
        return len(live) == 1 and not set(old.values()) & {p.metadata.uid for p in pods} and \
            mds.status(NAME).get("readyReplicas") == 1

    wait_until(group_back, GROUP_BACK_S, interval=0.5, what="the group back with a new pod")
    mds.wait_ready(NAME)
    assert sorted(name for uid, name in seen.items() if uid not in old.values()) == ["ha-0-0"]
    status = mds.status(NAME)
    assert status["restartsByReason"] == {"crash": 1} and status["groups"][0]["restarts"] == 1
    assert [e.reason for e in mds.events(NAME)].count("GroupRestart") == 1
    standby.check_running()
    response = mds.chat(NAME)
    assert response.status_code == 200, response.text
