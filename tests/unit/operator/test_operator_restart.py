"""An operator restarted at any moment makes the same decisions: a plan is a function of what is
read back, and a plan cut short after any of its actions (the operator killed there) is finished
by the next operator without duplicate pods, lost counts or doubled counts."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from shoal.lifecycle import Reason
from shoal_operator.observed import Observed
from shoal_operator.planner import plan
from tests.unit.operator.factories import CONFIG, Clock, make_md, pod_object
from tests.unit.operator.fake_api import FakeApi

TWO_NODES = {"engine": {"tp": 2, "nnodes": 2},
             "restartPolicy": {"maxGroupRestarts": 1, "backoff": {"initialSeconds": 0}}}


def _watchdog(api: FakeApi, clock: Clock) -> None:
    api.end("llm-0-1", 86, reason=Reason.WATCHDOG, finished_at=clock.now)


def _second_failure(api: FakeApi, clock: Clock) -> None:
    _watchdog(api, clock)
    api.step(clock.now)
    api.converge(clock.now)
    api.end("llm-0-0", 87, reason=Reason.CONSENSUS, finished_at=clock.now)


def _startup_failed_then_fixed(api: FakeApi, clock: Clock) -> None:
    api.end("llm-0-0", 88, reason=Reason.STARTUP_FAILED, finished_at=clock.now)
    api.step(clock.now)
    api.change_spec(engine={"tp": 2, "nnodes": 2, "args": ["--log-level", "debug"]})


def _rollout(api: FakeApi, clock: Clock) -> None:
    api.change_spec(replicas=2)
    api.converge(clock.now)
    api.change_spec(image="shoal:next")


def _scale_down(api: FakeApi, clock: Clock) -> None:
    api.change_spec(replicas=3)
    api.converge(clock.now)
    api.change_spec(replicas=1)


SCENARIOS: dict[str, Callable[[FakeApi, Clock], None]] = {
    "restart": _watchdog, "restart-limit": _second_failure,
    "startup-failed-fixed": _startup_failed_then_fixed, "rollout": _rollout,
    "scale-down": _scale_down,
}


def _outcome(api: FakeApi) -> tuple:
    groups = [{k: v for k, v in g.items() if not k.endswith("Time")}
              for g in api.status["groups"]]
    return (groups, api.status["restartsByReason"], api.status["readyReplicas"],
            sorted(api.events), api.live_pods(), api.status["phase"])


def _run(scenario: str, crash_after: int | None, crashes: int = 1) -> tuple[FakeApi, int]:
    clock = Clock()
    api = FakeApi(TWO_NODES)
    api.converge(clock.now)
    SCENARIOS[scenario](api, clock)
    actions = len(api.plan(clock.now).actions)
    for _ in range(crashes):  # the operator dies this many times in a row, at the same point
        api.step(clock.now, crash_after=crash_after)
    api.converge(clock.advance(1), rounds=20)
    return api, actions


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_plan_cut_short_anywhere_ends_the_same(scenario: str) -> None:
    reference, actions = _run(scenario, None)
    assert actions > 0
    for crash_after in range(actions):
        api, _ = _run(scenario, crash_after, crashes=2)
        assert _outcome(api) == _outcome(reference), f"crash after {crash_after} actions"
        assert api.created == reference.created  # not one pod more was ever created
        per_group: dict[str, int] = {}
        for name in api.live_pods():
            group = name.rsplit("-", 1)[0]
            per_group[group] = per_group.get(group, 0) + 1
        assert set(per_group.values()) <= {2}


def test_the_plan_is_a_function_of_what_is_read_back() -> None:
    md = make_md(TWO_NODES)
    pods = [pod_object(md, 0, 0, ready=True), pod_object(md, 0, 1, ready=True)]
    now = Clock().now
    first = plan(md, Observed.from_objects(pods, []), now, CONFIG)
    again = plan(make_md(TWO_NODES), Observed.from_objects(list(reversed(pods)), []), now, CONFIG)
    assert first == again


def test_counts_survive_a_lost_status() -> None:
    """Even with the status wiped, the pods' incarnation label keeps old pods from counting."""
    clock = Clock()
    api = FakeApi(TWO_NODES)
    api.converge(clock.now)
    _watchdog(api, clock)
    api.step(clock.now)
    api.converge(clock.now)
    assert api.group_status("llm-0")["incarnation"] == 1
    api.body["status"] = {}
    api.converge(clock.advance(1))
    assert api.group_status("llm-0")["incarnation"] == 1
    assert api.live_pods() == ["llm-0-0", "llm-0-1"]
