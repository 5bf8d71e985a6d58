"""Rolling a changed pod template through the groups, `rollout.maxUnavailable` and `maxSurge`
(counted in groups) honoured. Pure.

An outdated group is replaced by deleting its pods; the planner then recreates it on the
current template like any missing group. Groups that serve nothing (not Ready) go first, then
Ready ones from the highest replica index down, while at least `replicas - maxUnavailable` groups
stay Ready. With `maxSurge` > 0, extra groups at indices `replicas`, `replicas + 1`, ... are
created on the current template while the rollout runs and removed when it is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal_operator.spec import Rollout


@dataclass(frozen=True)
class GroupHealth:
    replica: int
    ready: bool
    outdated: bool  # running pods on an older template
    settled: bool  # Ready on the current template, or Failed (nothing to wait for)


def surge_replicas(desired: Sequence[GroupHealth], surge_exists: bool, replicas: int,
                   rollout: Rollout) -> range:
    """Indices of the surge groups to keep: while any desired group is outdated, and after
    that until every desired group has settled."""
    rolling = any(g.outdated for g in desired) or (
        surge_exists and not all(g.settled for g in desired))
    return range(replicas, replicas + rollout.max_surge) if rolling else range(0)


def groups_to_replace(groups: Sequence[GroupHealth], replicas: int,
                      rollout: Rollout) -> list[int]:
    """Replica indices of the outdated groups to delete now."""
    ready = sum(g.ready for g in groups)
    floor = replicas - rollout.max_unavailable
    chosen = []
    for group in sorted((g for g in groups if g.outdated), key=lambda g: (g.ready, -g.replica)):
        if group.ready:
            if ready - 1 < floor:
                break
            ready -= 1
        chosen.append(group.replica)
    return chosen
