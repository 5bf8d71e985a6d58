"""The planner on groups and their failures: creation, readiness, every reason a pod ends and
what happens then (recreate after backoff, Failed), the restart limit, startup failures without a
hot loop, peer-lost ends, stale and foreign pods. Fake clock, no cluster."""

from __future__ import annotations

import pytest

from shoal.lifecycle import Reason
from shoal_operator.actions import CreatePods, CreateService, DeletePods, EmitEvent, ReplaceStatus
from shoal_operator.failures import PEER_LOST_GRACE_S
from shoal_operator.observed import Observed, PodState
from shoal_operator.planner import FAILED_GROUP_GRACE_S, plan
from tests.unit.operator.factories import CONFIG, Clock, make_md, pod_object, terminating
from tests.unit.operator.fake_api import FakeApi

TWO_NODES = {"engine": {"tp": 2, "nnodes": 2}}


def _of(actions: tuple, kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def _ready_api(spec: dict | None = None, clock: Clock | None = None) -> FakeApi:
    api = FakeApi(spec if spec is not None else TWO_NODES)
    api.converge((clock or Clock()).now)
    return api


def test_a_new_deployment_gets_services_and_one_group_of_nnodes_pods_per_replica() -> None:
    md = make_md({"replicas": 2, **TWO_NODES})
    result = plan(md, Observed(), Clock().now, CONFIG)
    assert isinstance(result.actions[0], ReplaceStatus)  # on record before anything is created
    assert {a.service["metadata"]["name"] for a in _of(result.actions, CreateService)} == {
        "llm-nodes", "llm"}
    created = {a.group: [p["metadata"]["name"] for p in a.pods]
               for a in _of(result.actions, CreatePods)}
    assert created == {"llm-0": ["llm-0-0", "llm-0-1"], "llm-1": ["llm-1-0", "llm-1-1"]}
    status = result.actions[0].status
    assert [g["phase"] for g in status["groups"]] == ["Pending", "Pending"]
    assert status["observedGeneration"] == 1
    assert status["phase"] == "Progressing"
    assert status["endpoint"] == "llm.ns.svc.cluster.local:30000"


def test_a_group_is_ready_when_all_its_pods_are() -> None:
    api = FakeApi({"replicas": 2, **TWO_NODES})
    now = Clock().now
    api.step(now)
    api.start_all()
    api.pods["llm-1-1"]["status"]["conditions"][0]["status"] = "False"
    api.step(now)
    assert [g["phase"] for g in api.status["groups"]] == ["Ready", "Pending"]
    assert api.status["readyReplicas"] == 1
    assert api.condition("Available")["status"] == "True"  # 1 ready >= 2 - maxUnavailable
    assert api.condition("Progressing")["status"] == "True"
    api.start_all()
    api.step(now)
    assert api.status["readyReplicas"] == 2 and api.status["phase"] == "Ready"
    assert api.condition("Progressing")["reason"] == "Complete"
    assert api.condition("Degraded")["status"] == "False"
    assert api.step(now).actions == ()  # steady: nothing to write


@pytest.mark.parametrize("exit_code,reason,platform_reason,expected", [
    (86, Reason.WATCHDOG, "Error", "watchdog"),
    (87, Reason.CONSENSUS, "Error", "consensus"),
    (1, Reason.CRASH, "Error", "crash"),
    (137, Reason.CRASH, "Error", "crash"),  # a rank process SIGKILLed: the image says so
    (137, None, "Error", "crash"),  # the container itself killed: no message
    (137, None, "OOMKilled", "oom"),
    (0, None, "Completed", "crash"),  # an engine must not end on its own
    (86, None, "Error", "watchdog"),  # no message: the exit code alone
])
def test_each_reason_recreates_the_whole_group(exit_code: int, reason: Reason | None,
                                               platform_reason: str, expected: str) -> None:
    clock = Clock()
    api = _ready_api(clock=clock)
    old_uids = {p["metadata"]["uid"] for p in api.pods.values()}
    api.end("llm-0-1", exit_code, reason=reason, platform_reason=platform_reason,
            detail="no forward progress for 5s", finished_at=clock.now)
    result = api.step(clock.advance(1))
    group = api.group_status("llm-0")
    assert group["restarts"] == 1 and group["lastRestartReason"] == expected
    assert group["phase"] == "Restarting" and group["incarnation"] == 1
    assert group["lastTermination"]["pod"] == "llm-0-1"
    assert group["lastTermination"]["exitCode"] == exit_code
    assert api.status["restartsByReason"] == {expected: 1}
    assert api.status["restarts"] == 1
    (deleted,) = _of(result.actions, DeletePods)
    assert {p.name for p in deleted.pods} == {"llm-0-0", "llm-0-1"}
    assert deleted.grace_seconds == FAILED_GROUP_GRACE_S
    (event,) = _of(result.actions, EmitEvent)
    message = event.event["message"]
    assert event.event["reason"] == "GroupRestart" and event.event["type"] == "Warning"
    assert "llm-0-1" in message and "node rank 1" in message and str(exit_code) in message
    assert expected in message
    if reason is not None:
        assert "no forward progress for 5s" in message
    # after the backoff, the group comes back: every pod new
    api.remove_terminating()
    api.converge(clock.advance(10))
    assert api.status["readyReplicas"] == 1
    assert not old_uids & {p["metadata"]["uid"] for p in api.pods.values()}
    assert {p["metadata"]["labels"]["shoal.dev/incarnation"] for p in api.pods.values()} == {"1"}


@pytest.mark.parametrize("initial,maximum,delays", [
    (10, 300, [10, 20, 40, 80, 160, 300, 300]),
    (1, 4, [1, 2, 4, 4]),
    (0, 0, [0, 0]),
])
def test_backoff_doubles_up_to_the_maximum(initial: int, maximum: int,
                                           delays: list[int]) -> None:
    clock = Clock()
    api = _ready_api({**TWO_NODES, "restartPolicy": {
        "backoff": {"initialSeconds": initial, "maxSeconds": maximum}}}, clock)
    for delay in delays:
        api.end("llm-0-0", 86, reason=Reason.WATCHDOG, finished_at=clock.now)
        assert api.step(clock.now).requeue_after == delay
        api.remove_terminating()
        if delay:
            waiting = api.step(clock.advance(delay - 0.5))
            assert not _of(waiting.actions, CreatePods)  # no pod before the deadline
            assert waiting.requeue_after == pytest.approx(0.5)
            assert api.group_status("llm-0")["phase"] == "Restarting"
        created = api.step(clock.advance(0.5 if delay else 0))
        assert len(_of(created.actions, CreatePods)[0].pods) == 2
        api.start_all()
        api.step(clock.now)
    assert api.group_status("llm-0")["restarts"] == len(delays)


def test_past_max_group_restarts_the_group_fails_and_nothing_is_recreated() -> None:
    clock = Clock()
    api = _ready_api({**TWO_NODES, "restartPolicy": {"maxGroupRestarts": 1,
                                                     "backoff": {"initialSeconds": 1}}}, clock)
    api.end("llm-0-1", 87, reason=Reason.CONSENSUS, finished_at=clock.now)
    api.step(clock.now)
    api.remove_terminating()
    api.converge(clock.advance(1))
    api.end("llm-0-1", 87, reason=Reason.CONSENSUS, detail="hashes differ",
            finished_at=clock.now)
    result = api.step(clock.advance(1))
    group = api.group_status("llm-0")
    assert group["phase"] == "Failed" and group["failedReason"] == "RestartLimitReached"
    assert group["restarts"] == 1  # the failure that was not recreated is not a restart
    assert api.status["restartsByReason"] == {"consensus": 1}
    assert api.status["phase"] == "Failed"
    degraded = api.condition("Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "RestartLimitReached"
    assert "llm-0-1" in degraded["message"] and "hashes differ" in degraded["message"]
    (event,) = _of(result.actions, EmitEvent)
    assert event.event["reason"] == "GroupFailed"
    # the pod still running is stopped, the ended one kept (its logs)
    (deleted,) = _of(result.actions, DeletePods)
    assert [p.name for p in deleted.pods] == ["llm-0-0"]
    api.remove_terminating()
    for _ in range(3):
        later = api.step(clock.advance(600))
        assert not _of(later.actions, CreatePods) and not _of(later.actions, EmitEvent)
    assert list(api.pods) == ["llm-0-1"]


def test_startup_failed_is_never_hot_looped_until_the_spec_changes() -> None:
    clock = Clock()
    api = FakeApi({**TWO_NODES, "engine": {**TWO_NODES["engine"], "args": ["--bad-flag"]}})
    api.step(clock.now)
    api.end("llm-0-0", 88, reason=Reason.STARTUP_FAILED, detail="bad arguments: --bad-flag",
            finished_at=clock.now)
    api.step(clock.advance(1))
    assert api.group_status("llm-0")["failedReason"] == "StartupFailed"
    assert api.group_status("llm-0")["restarts"] == 0
    assert api.status["restartsByReason"] == {}
    assert api.condition("Degraded")["reason"] == "StartupFailed"
    api.remove_terminating()
    for _ in range(5):
        assert not _of(api.step(clock.advance(3600)).actions, CreatePods)
    # a new generation (the flag fixed): old pods go, the group comes back as a new incarnation
    api.change_spec(engine=TWO_NODES["engine"])
    result = api.step(clock.advance(1))
    assert [p.name for p in _of(result.actions, DeletePods)[0].pods] == ["llm-0-0"]
    assert api.group_status("llm-0")["incarnation"] == 1
    api.converge(clock.now)
    assert api.status["readyReplicas"] == 1 and api.status["phase"] == "Ready"
    assert api.condition("Degraded")["status"] == "False"
    assert "--bad-flag" not in api.pods["llm-0-0"]["spec"]["containers"][0]["args"]


def test_a_reason_not_listed_leaves_the_group_failed() -> None:
    clock = Clock()
    api = _ready_api({**TWO_NODES, "restartPolicy": {"recreateGroupOn": ["watchdog"]}}, clock)
    api.end("llm-0-0", 1, reason=Reason.CRASH, finished_at=clock.now)
    api.step(clock.now)
    assert api.group_status("llm-0")["failedReason"] == "NotRecreated"
    assert api.status["restartsByReason"] == {}


def test_a_peer_lost_end_waits_for_the_end_that_caused_it() -> None:
    clock = Clock()
    api = _ready_api(clock=clock)
    api.end("llm-0-0", 75, reason=Reason.PEER_LOST, finished_at=clock.now)
    waiting = api.step(clock.advance(1))
    assert waiting.requeue_after == pytest.approx(PEER_LOST_GRACE_S - 1)
    assert not _of(waiting.actions, DeletePods)
    api.end("llm-0-1", 86, reason=Reason.WATCHDOG, finished_at=clock.now)
    api.step(clock.advance(1))
    assert api.status["restartsByReason"] == {"watchdog": 1}
    assert api.group_status("llm-0")["lastTermination"]["pod"] == "llm-0-1"


def test_a_lone_peer_lost_end_counts_after_the_grace() -> None:
    clock = Clock()
    api = _ready_api(clock=clock)
    api.end("llm-0-0", 75, reason=Reason.PEER_LOST, finished_at=clock.now)
    api.step(clock.advance(PEER_LOST_GRACE_S))
    assert api.status["restartsByReason"] == {"peer-lost": 1}


def test_stale_and_terminating_pods_are_never_counted() -> None:
    clock = Clock()
    api = _ready_api(clock=clock)
    api.end("llm-0-1", 86, reason=Reason.WATCHDOG, finished_at=clock.now)
    api.step(clock.now)
    # the group's other pod ends too before it is gone, and a fresh pass runs: nothing recounted
    api.end("llm-0-0", 75, reason=Reason.PEER_LOST, finished_at=clock.now)
    api.pods["llm-0-0"] = terminating(api.pods["llm-0-0"])
    for _ in range(3):
        api.step(clock.advance(1))
    assert api.status["restarts"] == 1


def test_pods_of_a_previous_owner_block_their_names_until_gone() -> None:
    md = make_md(TWO_NODES)
    foreign = terminating(pod_object(md, 0, 0, owner_uid="old-uid"))
    result = plan(md, Observed.from_objects([foreign], []), Clock().now, CONFIG)
    (created,) = _of(result.actions, CreatePods)
    assert [p["metadata"]["name"] for p in created.pods] == ["llm-0-1"]
    assert not _of(result.actions, DeletePods)


def test_a_deleting_model_deployment_is_left_to_the_garbage_collector() -> None:
    md = make_md(TWO_NODES)
    md = md.__class__(**{**md.__dict__, "deleting": True})
    assert plan(md, Observed(), Clock().now, CONFIG).actions == ()


def test_a_missing_pod_of_a_group_is_created_again() -> None:
    md = make_md(TWO_NODES)
    pods = [pod_object(md, 0, 0, ready=True)]
    result = plan(md, Observed.from_objects(pods, []), Clock().now, CONFIG)
    (created,) = _of(result.actions, CreatePods)
    assert [p["metadata"]["name"] for p in created.pods] == ["llm-0-1"]


def test_a_pod_ended_without_container_status_is_a_crash() -> None:
    md = make_md(TWO_NODES)
    pod = pod_object(md, 0, 0)
    pod["status"] = {"phase": "Failed", "reason": "Evicted", "message": "low on memory"}
    state = PodState.from_object(pod)
    assert state is not None and state.ended
    api = _ready_api()
    api.pods["llm-0-0"]["status"] = pod["status"]
    api.step(Clock().now)
    assert api.status["restartsByReason"] == {"crash": 1}
