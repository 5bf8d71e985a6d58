"""Acceptance 3 (consensus), 4 and 5: a consensus divergence recreates the group once and, with
`maxGroupRestarts: 1`, leaves it Failed the second time; an engine that cannot start (88) is
not restarted until its spec is fixed; deleting the ModelDeployment removes every pod, Service
and process."""

from __future__ import annotations

import time

from tests.e2e.kube.operator.conftest import (
    ENGINE_ARGS,
    ONE_CORE_EACH,
    Deployments,
    rendezvous_env,
    wait_restarted,
)
from tests.support.wait import wait_until

QUIET_S = 8.0  # how long "nothing happens" is watched
DIVERGE_AFTER_EVENTS = 30  # an event per scheduling step: 4 tokens are ~6, 64 tokens ~66


def test_consensus_divergence_recreates_then_fails_past_the_limit(
        deployments: Deployments) -> None:
    mds = deployments
    mds.create("cons", {
        "engine": {"tp": 2, "nnodes": 2, "resources": ONE_CORE_EACH,
                   "args": [*ENGINE_ARGS, "--enable-rank-consensus-check"],
                   "env": [{"name": "SHOAL_FAULT",
                            "value": f"diverge_consensus:rank=1:after_events="
                                     f"{DIVERGE_AFTER_EVENTS}"},
                           rendezvous_env(mds.namespace, "cons")]},
        "restartPolicy": {"maxGroupRestarts": 1, "backoff": {"initialSeconds": 1}}})
    mds.wait_ready("cons")
    old = mds.pod_uids("cons")
    mds.chat_until_it_breaks("cons", 2 * DIVERGE_AFTER_EVENTS)
    status = wait_restarted(mds, "cons", "consensus", 1, old)
    assert status["groups"][0]["lastTermination"]["exitCode"] == 87
    event = next(e for e in mds.events("cons") if e.reason == "GroupRestart")
    assert "exited 87 (consensus" in event.message
    mds.wait_ready("cons")
    assert not set(old.values()) & set(mds.pod_uids("cons").values())
    response = mds.chat("cons", max_tokens=4)  # few events: below the fault's threshold
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]

    # the fault recurs in the new incarnation: past maxGroupRestarts the group stays Failed
    mds.chat_until_it_breaks("cons", 2 * DIVERGE_AFTER_EVENTS)
    wait_until(lambda: mds.status("cons").get("phase") == "Failed", 120, interval=0.5,
               what="cons not Failed")
    degraded = mds.condition("cons", "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "RestartLimitReached"
    assert "exited 87" in degraded["message"]
    assert any(e.reason == "GroupFailed" for e in mds.events("cons"))
    failed_uids = mds.pod_uids("cons")
    time.sleep(QUIET_S)
    status = mds.status("cons")
    assert status["restartsByReason"] == {"consensus": 1}
    assert status["groups"][0]["phase"] == "Failed"
    assert set(mds.pod_uids("cons").values()) <= set(failed_uids.values())  # nothing new


def test_startup_failure_waits_for_a_fixed_spec_and_deletion_removes_everything(
        deployments: Deployments) -> None:
    mds = deployments
    mds.create("boot", {"engine": {"args": ["--no-such-flag"]},
                        "restartPolicy": {"backoff": {"initialSeconds": 0}}})
    wait_until(lambda: mds.status("boot").get("phase") == "Failed", 120, interval=0.5,
               what="boot not Failed")
    degraded = mds.condition("boot", "Degraded")
    assert degraded["reason"] == "StartupFailed" and "exited 88" in degraded["message"]
    assert "--no-such-flag" in degraded["message"]
    first = mds.pod_uids("boot")
    time.sleep(QUIET_S)  # no restart loop: the ended pod stays (its logs), nothing new
    assert mds.pod_uids("boot") == first
    assert mds.status("boot")["restarts"] == 0

    mds.patch_spec("boot", {"engine": {"args": ["--max-total-tokens", "4096"]}})
    mds.wait_ready("boot")
    assert mds.condition("boot", "Degraded")["status"] == "False"
    assert not set(first.values()) & set(mds.pod_uids("boot").values())
    assert mds.kubelet.namespace_processes(mds.namespace)

    mds.delete("boot")
    wait_until(lambda: not mds.exists("boot") and not mds.pods("boot")
               and not mds.services("boot"), 120, interval=0.5,
               what="pods or Services of boot left after its deletion")
    wait_until(lambda: not mds.kubelet.namespace_processes(mds.namespace), 60,
               what="processes of boot's pods left")

