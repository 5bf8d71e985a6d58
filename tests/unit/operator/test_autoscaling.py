"""The autoscaler's decision (autoscaling.decide), pass after pass on a fake clock: the HPA's
algorithm on the engine's signals, its stabilization windows and step limits, and which groups
count."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from shoal_operator.autoscaling import GroupSignal, decide
from shoal_operator.spec import Autoscaling, ScalingRules
from shoal_operator.status import ScalingRecord
from tests.unit.operator.factories import Clock

RULES = Autoscaling(min_replicas=1, max_replicas=4, metric="queuedRequests", target=2,
                    scale_up=ScalingRules(0, 4, 15), scale_down=ScalingRules(60, 1, 30))


def ready(*values: float) -> list[GroupSignal]:
    return [GroupSignal(f"g{i}", True, False, v) for i, v in enumerate(values)]


@dataclass(frozen=True)
class Step:
    after_s: float  # since the previous step
    groups: list[GroupSignal]
    expect: int  # replicas after this pass


def run(steps: list[Step], start: int, rules: Autoscaling = RULES) -> list[int]:
    """Each pass's decision, the replicas following it as the operator writes them."""
    clock, record, current, seen = Clock(), ScalingRecord("engine"), start, []
    for step in steps:
        clock.advance(step.after_s)
        decision = decide(rules, record, current, step.groups, clock.now)
        record, current = decision.record, decision.replicas
        seen.append(current)
    return seen


CASES = {
    "a queue above target adds groups at once": (
        1, [Step(0, ready(6), 3)]),
    "within 10% of the target nothing changes": (
        2, [Step(0, ready(2.1, 2.2), 2)]),
    "an idle role shrinks one group per period after the window": (
        3, [Step(0, ready(0, 0, 0), 3), Step(30, ready(0, 0, 0), 3),
            Step(31, ready(0, 0, 0), 2), Step(10, ready(0, 0), 2), Step(25, ready(0, 0), 1)]),
    "flapping within the scale-down window never oscillates": (
        1, [Step(0, ready(6), 3), Step(20, ready(0, 0, 0), 3), Step(20, ready(6, 6, 6), 4),
            Step(20, ready(0, 0, 0, 0), 4), Step(20, ready(3, 3, 3, 3), 4),
            Step(20, ready(0, 0, 0, 0), 4), Step(30, ready(0, 0, 0, 0), 4)]),
    "maxReplicas bounds a burst": (
        1, [Step(0, ready(100), 4)]),
    "minReplicas bounds an idle role, after the window": (
        1, [Step(0, ready(0), 1), Step(120, ready(0), 1)]),
    "replicas set by hand above maxReplicas return to it at once": (
        7, [Step(0, ready(2, 2, 2, 2, 2, 2, 2), 4)]),
    "replicas set by hand below minReplicas rise to it at once": (
        0, [Step(0, [], 1)]),
    "a group that is not Ready is not averaged, and counts as idle when scaling up": (
        2, [Step(0, [*ready(3), GroupSignal("g1", False, False, 40)], 2)]),
    "a starting group counts as on target when scaling down": (
        3, [Step(0, [*ready(1, 0), GroupSignal("g2", False, False, None)], 3),
            Step(61, [*ready(1, 0), GroupSignal("g2", False, False, None)], 2)]),
    "a Failed group is not averaged: its replica serves nothing": (
        2, [Step(0, [*ready(8), GroupSignal("g1", False, True, 0)], 4)]),
    "without a Ready group's signal the replicas are kept": (
        3, [Step(0, [GroupSignal("g0", True, False, None),
                     GroupSignal("g1", False, False, 9)], 3)]),
}


@pytest.mark.parametrize(("start", "steps"), list(CASES.values()), ids=list(CASES))
def test_decisions(start: int, steps: list[Step]) -> None:
    assert run(steps, start) == [s.expect for s in steps]


def test_scale_up_step_limit_counts_the_period() -> None:
    rules = Autoscaling(1, 10, "runningRequests", 1, scale_up=ScalingRules(0, 2, 60),
                        scale_down=ScalingRules(300, 1, 60))
    steps = [Step(0, ready(10), 3), Step(30, ready(5, 5, 5), 3), Step(31, ready(5, 5, 5), 5),
             Step(61, ready(2, 2, 2, 2, 2), 7)]
    assert run(steps, 1, rules) == [s.expect for s in steps]


def test_scale_up_window_waits_for_a_sustained_load() -> None:
    rules = Autoscaling(1, 4, "queuedRequests", 2, scale_up=ScalingRules(30, 4, 15),
                        scale_down=ScalingRules(0, 4, 15))
    steps = [Step(0, ready(8), 1), Step(10, ready(8), 1), Step(21, ready(8), 4)]
    assert run(steps, 1, rules) == [s.expect for s in steps]


def test_the_decision_is_recorded_with_its_reason() -> None:
    clock = Clock()
    decision = decide(RULES, ScalingRecord("engine"), 1, ready(5), clock.now)
    record = decision.record
    assert decision.replicas == 3
    assert record.signal == 5 and record.ready_groups == 1 and record.desired_replicas == 3
    assert record.last_decision is not None
    assert (record.last_decision.from_replicas, record.last_decision.to_replicas) == (1, 3)
    assert "queuedRequests averages 5 over 1 Ready group(s) (target 2)" in decision.reason
    again = decide(RULES, record, 3, ready(2, 2, 2), clock.advance(5))
    assert again.replicas == 3 and again.record.last_decision == record.last_decision
    assert len(again.record.changes) == 1


def test_kv_usage_targets_a_share() -> None:
    rules = Autoscaling(1, 8, "kvCacheUsage", 0.5)
    assert decide(rules, ScalingRecord("decode"), 2, ready(0.9, 0.8), Clock().now).replicas == 4
