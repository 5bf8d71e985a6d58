"""The planner on scale and rollout: replicas up and down (highest index first), a changed pod
template rolled group by group within maxUnavailable / maxSurge."""

from __future__ import annotations

import pytest

from shoal_operator import builders
from shoal_operator.actions import CreatePods, DeletePods
from shoal_operator.rollout import GroupHealth, groups_to_replace, surge_replicas
from shoal_operator.spec import Rollout
from tests.unit.operator.factories import CONFIG, Clock, make_md
from tests.unit.operator.fake_api import FakeApi

ONE_NODE = {"engine": {"tp": 1}}


def _groups_of(names: list[str]) -> list[str]:
    return sorted({n.rsplit("-", 1)[0] for n in names})


def test_scale_up_creates_the_missing_groups() -> None:
    api = FakeApi({**ONE_NODE, "replicas": 1})
    now = Clock().now
    api.converge(now)
    api.change_spec(replicas=3)
    result = api.step(now)
    assert [a.group for a in result.actions if isinstance(a, CreatePods)] == ["llm-1", "llm-2"]
    api.converge(now)
    assert api.status["readyReplicas"] == 3 and api.status["replicas"] == 3


def test_scale_down_removes_the_highest_groups_first() -> None:
    api = FakeApi({**ONE_NODE, "replicas": 4})
    now = Clock().now
    api.converge(now)
    api.change_spec(replicas=2)
    result = api.step(now)
    deletes = [a for a in result.actions if isinstance(a, DeletePods)]
    assert [d.group for d in deletes] == ["llm-3", "llm-2"]
    assert all(d.grace_seconds is None for d in deletes)  # a drain, not a failure
    assert [g["phase"] for g in api.status["groups"]] == ["Ready", "Ready", "Terminating",
                                                            "Terminating"]
    assert api.condition("Progressing")["reason"] == "ScalingDown"
    api.converge(now)
    assert [g["name"] for g in api.status["groups"]] == ["llm-0", "llm-1"]
    assert api.live_pods() == ["llm-0-0", "llm-1-0"]


def test_scale_to_zero_and_back() -> None:
    api = FakeApi({**ONE_NODE, "replicas": 1})
    now = Clock().now
    api.converge(now)
    api.change_spec(replicas=0)
    api.converge(now)
    assert api.pods == {} and api.status["groups"] == []
    assert api.condition("Available")["reason"] == "ScaledToZero"
    api.change_spec(replicas=1)
    api.converge(now)
    assert api.status["readyReplicas"] == 1


@pytest.mark.parametrize("changes", [
    {"image": "shoal:next"},
    {"engine": {"tp": 1, "args": ["--max-total-tokens", "4096"]}},
    {"engine": {"tp": 1, "env": [{"name": "X", "value": "1"}]}},
    {"engine": {"tp": 1, "resources": {"limits": {"cpu": "2"}}}},
    {"podTemplate": {"nodeSelector": {"gpu": "h100"}}},
    {"model": {"path": "/models/qwen"}},
])
def test_the_template_hash_covers_what_defines_a_pod(changes: dict) -> None:
    before = builders.template_hash(make_md(ONE_NODE), CONFIG)
    assert builders.template_hash(make_md({**ONE_NODE, **changes}), CONFIG) != before


@pytest.mark.parametrize("changes", [
    {"replicas": 5},
    {"restartPolicy": {"maxGroupRestarts": 1}},
    {"rollout": {"maxUnavailable": 2}},
])
def test_the_template_hash_ignores_what_does_not(changes: dict) -> None:
    before = builders.template_hash(make_md(ONE_NODE), CONFIG)
    assert builders.template_hash(make_md({**ONE_NODE, **changes}), CONFIG) == before


def _roll(api: FakeApi, now: object, max_rounds: int = 30) -> list[list[str]]:
    """Run a rollout to its end, one pod-level round at a time; returns the groups deleted in
    each round, and checks that never more groups were down than the rollout allows."""
    rollout = api.md().spec.rollout
    replicas = api.md().spec.replicas
    deleted_rounds = []
    for _ in range(max_rounds):
        result = api.step(now)
        deleted = [a.group for a in result.actions if isinstance(a, DeletePods)]
        if deleted:
            deleted_rounds.append(deleted)
        ready = api.status["readyReplicas"]
        assert ready >= replicas - rollout.max_unavailable
        assert len({g["name"] for g in api.status["groups"]}) <= replicas + rollout.max_surge
        if not result.actions:
            return deleted_rounds
        api.remove_terminating()
        api.start_all()
    raise AssertionError("the rollout did not finish")


def test_a_rollout_goes_one_group_at_a_time_from_the_highest() -> None:
    api = FakeApi({**ONE_NODE, "replicas": 3})
    now = Clock().now
    api.converge(now)
    api.change_spec(image="shoal:next")
    assert _roll(api, now) == [["llm-2"], ["llm-1"], ["llm-0"]]
    images = {p["spec"]["containers"][0]["image"] for p in api.pods.values()}
    assert images == {"shoal:next"} and api.status["updatedReplicas"] == 3
    assert api.status["phase"] == "Ready"


def test_max_unavailable_two_rolls_two_groups_at_once() -> None:
    api = FakeApi({**ONE_NODE, "replicas": 3, "rollout": {"maxUnavailable": 2}})
    now = Clock().now
    api.converge(now)
    api.change_spec(image="shoal:next")
    assert _roll(api, now) == [["llm-2", "llm-1"], ["llm-0"]]


def test_max_surge_brings_a_new_group_up_before_an_old_one_goes() -> None:
    api = FakeApi({**ONE_NODE, "replicas": 2, "rollout": {"maxUnavailable": 0, "maxSurge": 1}})
    now = Clock().now
    api.converge(now)
    api.change_spec(image="shoal:next")
    first = api.step(now)
    assert [a.group for a in first.actions if isinstance(a, CreatePods)] == ["llm-2"]
    assert not [a for a in first.actions if isinstance(a, DeletePods)]
    api.start_all()
    assert _roll(api, now) == [["llm-1"], ["llm-0"], ["llm-2"]]  # the surge group last
    assert api.live_pods() == ["llm-0-0", "llm-1-0"]


def test_groups_that_serve_nothing_are_replaced_first() -> None:
    groups = [GroupHealth(0, True, True, False), GroupHealth(1, False, True, False),
              GroupHealth(2, True, True, False)]
    assert groups_to_replace(groups, 3, Rollout(max_unavailable=1)) == [1]
    assert groups_to_replace(groups, 3, Rollout(max_unavailable=2)) == [1, 2]


def test_no_ready_group_goes_below_the_floor() -> None:
    groups = [GroupHealth(0, True, True, False), GroupHealth(1, False, False, False)]
    assert groups_to_replace(groups, 2, Rollout(max_unavailable=1)) == []


def test_surge_groups_stay_until_every_desired_group_settled() -> None:
    settled = GroupHealth(0, True, False, True)
    starting = GroupHealth(1, False, False, False)
    rollout = Rollout(max_unavailable=0, max_surge=1)
    assert surge_replicas([settled, starting], True, 2, rollout) == range(2, 3)
    assert surge_replicas([settled, settled], True, 2, rollout) == range(0)
    assert surge_replicas([settled, starting], False, 2, rollout) == range(0)  # no rollout
