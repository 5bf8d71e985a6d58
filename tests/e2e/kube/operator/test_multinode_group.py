"""Acceptance 2, 3 (watchdog, SIGKILL) and 7 on one multi-node group: `replicas: 1`, `engine:
{tp: 2, nnodes: 2}` on the default model, two pods of one rank each that find each other by DNS
name. The tests share the group (starting one takes a minute on this machine) and run in file
order; each begins with the group Ready and leaves it Ready.

The group carries `SHOAL_FAULT=hang_forward:rank=1:after_steps=40`: every incarnation of rank 1
hangs after 40 forward passes, so short requests (a few forwards) work and a long one triggers
the watchdog (5 s)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.e2e.kube.operator.conftest import (
    ENGINE_ARGS,
    ONE_CORE_EACH,
    Deployments,
    Operator,
    rendezvous_env,
    wait_restarted,
)
from tests.support.wait import wait_until

NAME = "llm"
HANG_AFTER_STEPS = 40
FAULT = {"name": "SHOAL_FAULT", "value": f"hang_forward:rank=1:after_steps={HANG_AFTER_STEPS}"}


@pytest.fixture(scope="module")
def group(module_deployments: Deployments) -> Deployments:
    rendezvous = rendezvous_env(module_deployments.namespace, NAME)
    module_deployments.create(NAME, {
        "replicas": 1,
        "engine": {"tp": 2, "nnodes": 2, "args": ENGINE_ARGS, "env": [FAULT, rendezvous],
                   "resources": ONE_CORE_EACH},
        # backoffs 3 and 6 s for the two restarts below: the second leaves time to kill the
        # operator while the group waits
        "restartPolicy": {"backoff": {"initialSeconds": 3, "maxSeconds": 6}},
    })
    return module_deployments


@pytest.fixture
def mds(group: Deployments) -> Deployments:
    group.wait_ready(NAME)
    return group


def _assert_serves(mds: Deployments) -> str:
    response = mds.chat(NAME, max_tokens=8)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["message"]["content"]
    assert text.strip()
    return text


def _restart_event(mds: Deployments, incarnation: int) -> Any:
    return wait_until(lambda: next((e for e in mds.events(NAME) if e.reason == "GroupRestart"
                                    and e.metadata.name.endswith(f".restart-{incarnation}")),
                                   None), 30, what=f"no GroupRestart event #{incarnation}")


def test_two_pods_one_rank_each_serve_through_the_service(mds: Deployments) -> None:
    status = mds.status(NAME)
    assert status["readyReplicas"] == 1 and status["replicas"] == 1
    assert status["endpoint"] == f"{NAME}.{mds.namespace}.svc.cluster.local:30000"
    pods = {p.metadata.name: p for p in mds.pods(NAME)}
    assert sorted(pods) == ["llm-0-0", "llm-0-1"]
    for rank, pod in enumerate(pods.values()):
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert env["SHOAL_NODE_RANK"] == str(rank)
        assert env["SHOAL_DIST_INIT_ADDR"].startswith(  # the DNS name of the group's node 0
            f"llm-0-0.llm-nodes.{mds.namespace}.svc.cluster.local:")
        assert (pod.spec.hostname, pod.spec.subdomain) == (pod.metadata.name, "llm-nodes")
        # one rank per pod: this pod's scheduler and no other
        mds.rank_process(pod.metadata.name, f"shoal::scheduler_TP{rank}")
        titles = " ".join(" ".join(p.cmdline()) for p in
                          mds.kubelet.pod_processes(mds.namespace, pod.metadata.name))
        assert f"shoal::scheduler_TP{1 - rank}" not in titles
    assert sorted(mds.services(NAME)) == ["llm", "llm-nodes"]
    # the address the Service's EndpointSlice lists is node 0's pod
    assert mds.serving_address(NAME) == f"http://{pods['llm-0-0'].status.pod_ip}:30000"
    _assert_serves(mds)


def _hang(mds: Deployments) -> threading.Thread:
    """A request long enough to reach the injected hang, on a thread (it fails when the group
    goes)."""
    thread = threading.Thread(target=mds.chat_until_it_breaks,
                              args=(NAME, 4 * HANG_AFTER_STEPS), daemon=True)
    thread.start()
    return thread


def test_a_hung_rank_recreates_the_whole_group(mds: Deployments) -> None:
    old = mds.pod_uids(NAME)
    hanging = _hang(mds)
    status = wait_restarted(mds, NAME, "watchdog", 1, old)
    assert status["restartsByReason"] == {"watchdog": 1}
    ending = status["groups"][0]["lastTermination"]
    assert (ending["exitCode"], ending["reason"]) == (86, "watchdog")
    event = _restart_event(mds, 1)
    assert "exited 86 (watchdog" in event.message and "no forward progress" in event.message
    mds.wait_ready(NAME)
    hanging.join(timeout=90)
    assert not set(old.values()) & set(mds.pod_uids(NAME).values())
    _assert_serves(mds)  # a few forwards: below the fault's threshold again


def test_a_killed_rank_recreates_the_group_once_across_an_operator_restart(
        mds: Deployments, operator: Operator) -> None:
    """SIGKILL of a rank process: the pod ends 137, the group is recreated; the operator is
    SIGKILLed too, after it counted the failure and before the group came back, and the next
    operator neither recounts it nor creates a pod twice."""
    old = mds.pod_uids(NAME)
    mds.rank_process("llm-0-1", "shoal::scheduler_TP1").kill()
    wait_until(lambda: mds.status(NAME)["groups"][0]["phase"] == "Restarting", 60,
               interval=0.1, what="group not Restarting")
    operator.kill()  # the group now waits out its 6 s backoff with no operator
    counted = mds.status(NAME)
    assert counted["restartsByReason"] == {"watchdog": 1, "crash": 1}
    ending = counted["groups"][0]["lastTermination"]
    assert (ending["pod"], ending["exitCode"], ending["reason"]) == ("llm-0-1", 137, "crash")
    time.sleep(2)
    operator.start()
    seen: dict[str, str] = {}

    def group_back() -> bool:  # records every pod that appears until the group is back
        pods = mds.pods(NAME)
        seen.update({p.metadata.uid: p.metadata.name for p in pods})
        live = [p for p in pods if not p.metadata.deletion_timestamp]
        assert len(live) <= 2, [p.metadata.name for p in live]
        return len(live) == 2 and not set(old.values()) & {p.metadata.uid for p in pods} and \
            mds.status(NAME).get("readyReplicas") == 1

    wait_until(group_back, 300, interval=0.5, what="the group back with two new pods")
    mds.wait_ready(NAME)
    new = sorted(name for uid, name in seen.items() if uid not in old.values())
    assert new == ["llm-0-0", "llm-0-1"]  # each created once: no duplicates
    status = mds.status(NAME)
    assert status["restartsByReason"] == {"watchdog": 1, "crash": 1}  # not counted again
    assert status["groups"][0]["restarts"] == 2
    event = _restart_event(mds, 2)
    assert "llm-0-1" in event.message and "node rank 1" in event.message
    assert "exited 137" in event.message and "SIGKILL" in event.message
    assert [e.reason for e in mds.events(NAME)].count("GroupRestart") == 2
    operator.check_running()
    _assert_serves(mds)
