"""How many groups a role should run, from its groups' load signals: the HPA's algorithm on
the engine's own signals. Pure.

One decision per pass for each role with autoscaling:
1. the signal is averaged over the role's Ready groups that reported it; a group that is not
   Ready (starting, restarting) or Failed is not averaged. With none, the replicas are kept;
2. within 10% of the target nothing changes. Above it, the recommendation is
   ceil(sum / target) groups, never fewer than now (groups still starting count as idle, so
   they are waited for rather than scaled past); below it, ceil((sum + target * starting) /
   target), never more than now (starting groups count as exactly on target). Failed groups
   count as nothing: their replicas do not serve;
3. the recommendation, clamped to [minReplicas, maxReplicas], is recorded with its time; the
   role scales up only to the lowest recommendation that stood within the scale-up
   stabilization window, and down only to the highest within the scale-down window, so a
   signal that flaps within a window changes nothing (before the first recorded
   recommendation, the current replicas stood: a restarted memory waits a full window);
4. at most `maxGroups` groups are added (removed) within any `periodSeconds`, counting the
   changes recorded in that period;
5. [minReplicas, maxReplicas] win over everything: replicas set outside them (by hand) return
   to the bound at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from shoal_operator.spec import Autoscaling, ScalingRules
from shoal_operator.status import (
    Recommendation,
    ScaleChange,
    ScalingRecord,
    format_time,
    parse_time,
)

TOLERANCE = 0.1  # the HPA's: a ratio to the target within 10% of 1 changes nothing


@dataclass(frozen=True)
class GroupSignal:
    """One group of the role as the planner saw it: Ready or not, Failed or not, and the
    signal its node-0 server reported (None: not read)."""

    group: str
    ready: bool
    failed: bool
    value: float | None


@dataclass(frozen=True)
class Decision:
    replicas: int  # what spec's replicas should be now
    record: ScalingRecord  # the role's memory, to go to the status

    @property
    def reason(self) -> str:
        return self.record.reason


def decide(rules: Autoscaling, record: ScalingRecord, current: int,
           groups: Sequence[GroupSignal], now: datetime) -> Decision:
    """The role's replicas now, from its `current` spec replicas, its groups, and `record`
    (the recommendations and changes of earlier passes)."""
    signal, ready, recommended, why = _recommend(rules, current, groups)
    stamp = format_time(now)
    history = record.recommendations
    if not history or history[-1].replicas != recommended:
        history = (*history, Recommendation(stamp, recommended))
    longest = max(rules.scale_up.stabilization_window_s, rules.scale_down.stabilization_window_s)
    history = _standing(history, now, longest)
    changes = tuple(c for c in record.changes if _age(c.time, now) <= max(
        rules.scale_up.period_s, rules.scale_down.period_s))

    up_floor = min(_stood(history, now, rules.scale_up.stabilization_window_s, current))
    down_ceiling = max(_stood(history, now, rules.scale_down.stabilization_window_s, current))
    desired, held = current, ""
    if current < up_floor:
        desired = min(up_floor, _step_limit(current, changes, rules.scale_up, now, up=True))
        if desired < up_floor:
            held = f"; at most {rules.scale_up.max_groups} added per {rules.scale_up.period_s}s"
    elif current > down_ceiling:
        desired = max(down_ceiling, _step_limit(current, changes, rules.scale_down, now,
                                                up=False))
        if desired > down_ceiling:
            held = (f"; at most {rules.scale_down.max_groups} removed per "
                    f"{rules.scale_down.period_s}s")
    elif recommended > current:
        held = (f"; {up_floor} stood within the scale-up window of "
                f"{rules.scale_up.stabilization_window_s}s")
    elif recommended < current:
        held = (f"; {down_ceiling} stood within the scale-down window of "
                f"{rules.scale_down.stabilization_window_s}s")
    desired = _clamp(desired, rules)
    reason = f"{why}: {recommended} recommended, {desired} wanted{held}"
    out = ScalingRecord(role=record.role, metric=rules.metric, signal=signal,
                        ready_groups=ready, desired_replicas=desired, reason=reason,
                        recommendations=history, changes=changes,
                        last_decision=record.last_decision)
    if desired != current:
        change = ScaleChange(stamp, current, desired, reason)
        out = replace(out, changes=(*changes, change), last_decision=change)
    return Decision(desired, out)


def _recommend(rules: Autoscaling, current: int, groups: Sequence[GroupSignal]
               ) -> tuple[float | None, int, int, str]:
    """(the average signal, the groups averaged, the recommended replicas, why) for this pass
    alone (steps 1-2 and the bounds)."""
    counted = [g.value for g in groups if g.ready and not g.failed and g.value is not None]
    if not counted:
        return None, 0, _clamp(current, rules), f"no Ready group reports {rules.metric}"
    starting = sum(1 for g in groups if not g.ready and not g.failed)
    total = sum(counted)
    signal = round(total / len(counted), 4)
    recommended = _clamp(_raw(total, len(counted), starting, current, rules.target), rules)
    return signal, len(counted), recommended, (
        f"{rules.metric} averages {signal:g} over {len(counted)} Ready group(s) "
        f"(target {rules.target:g})")


def _raw(total: float, counted: int, starting: int, current: int, target: float) -> int:
    ratio = total / counted / target
    if abs(ratio - 1) <= TOLERANCE:
        return current
    if ratio > 1:
        return max(current, math.ceil(total / target - 1e-9))
    return min(current, math.ceil((total + starting * target) / target - 1e-9))


def _clamp(replicas: int, rules: Autoscaling) -> int:
    return min(max(replicas, rules.min_replicas), rules.max_replicas)


def _time(stamp: str) -> datetime:
    moment = parse_time(stamp)
    if moment is None:
        raise ValueError("status.autoscaling: a recorded time is empty")
    return moment


def _age(stamp: str, now: datetime) -> float:
    return (now - _time(stamp)).total_seconds()


def _standing(history: tuple[Recommendation, ...], now: datetime,
              window_s: int) -> tuple[Recommendation, ...]:
    """The recommendations that stood at some moment of the last `window_s` seconds: those
    made within it, and the one made before it that still stood at its start."""
    start = now - timedelta(seconds=window_s)
    inside = [i for i, r in enumerate(history) if _time(r.time) >= start]
    if not inside:
        return history[-1:]
    first = inside[0]
    if first > 0 and _time(history[first].time) > start:
        first -= 1
    return history[first:]


def _stood(history: tuple[Recommendation, ...], now: datetime, window_s: int,
           current: int) -> list[int]:
    """The replicas recommended within the window; when the memory began inside it, the
    current replicas stood before that."""
    standing = _standing(history, now, window_s)
    out = [r.replicas for r in standing]
    if _time(standing[0].time) > now - timedelta(seconds=window_s):
        out.append(current)
    return out


def _step_limit(current: int, changes: tuple[ScaleChange, ...], rules: ScalingRules,
                now: datetime, *, up: bool) -> int:
    """The most (up) or fewest (down) replicas allowed now: the replicas at the start of the
    period, plus (minus) maxGroups."""
    recent = [c for c in changes if _age(c.time, now) < rules.period_s]
    if up:
        added = sum(max(0, c.to_replicas - c.from_replicas) for c in recent)
        return max(current, current - added + rules.max_groups)
    removed = sum(max(0, c.from_replicas - c.to_replicas) for c in recent)
    return min(current, current + removed - rules.max_groups)
