"""The planner: (ModelDeployment, observed pods and Services, now) -> actions. Pure; every
decision the operator makes is made here.

One pass, reading nothing but its arguments, for each role the spec runs (colocated `engine`
groups, or `prefill` and `decode` groups; a role it no longer runs has no replicas):
0. a spec the operator refuses (refusals.py: a hostPath volume without the opt-in) gets an
   Event and a Failed status naming the field, and nothing else;
1. the Services exist (the router's Deployment and the NetworkPolicy are as the spec says, or
   gone);
2. each desired group (replica 0 .. replicas-1) is judged: pods of an older incarnation are
   deleted; a group whose pod ended is restarted (after backoff) or marked Failed
   (failures.py); a group past its backoff gets its missing pods;
3. during a rollout, surge groups are kept, and outdated groups are replaced within
   maxUnavailable (rollout.py); groups beyond `replicas` are removed, highest first;
3a. with autoscaling, the role's replicas are decided from its groups' signals
   (autoscaling.py); a change is written to the spec, with an Event, and planned by the next
   pass;
4. the status is rebuilt from all of that (Degraded `CreateRefused`, with an Event, while a
   create the API refused on the pass before is planned again), and written (after the
   Events, before any pod is touched) when it changed, so counts and deadlines are on record
   before pods go. An Event's name is derived from what it reports: one repeated by a pass
   after a crash is not created twice.

A group's restart bumps its `incarnation` in the status in the same write that counts it: from
then on its old pods are stale (their `shoal.dev/incarnation` label is lower) and only deleted,
never counted again, whether the operator restarts in between or not.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from shoal_operator import builders, names
from shoal_operator.actions import (
    Action,
    ApplyNetworkPolicy,
    CreateDeployment,
    CreatePods,
    CreateService,
    DeleteNetworkPolicy,
    DeletePods,
    DeleteRouter,
    EmitEvent,
    PatchDeployment,
    PodRef,
    ReplaceStatus,
    ScaleRole,
)
from shoal_operator.autoscaling import GroupSignal, decide
from shoal_operator.conditions import Summary, conditions, phase, refused_conditions
from shoal_operator.config import OperatorConfig
from shoal_operator.failures import Fail, Restart, Wait, judge
from shoal_operator.observed import Observed, PodState
from shoal_operator.refusals import Refusal, refusals
from shoal_operator.rollout import GroupHealth, groups_to_replace, surge_replicas
from shoal_operator.spec import ModelDeployment, Role
from shoal_operator.status import (
    GroupRecord,
    ScalingRecord,
    format_deadline,
    format_time,
    parse_time,
    seconds_between,
)

FAILED_GROUP_GRACE_S = 5  # a failed group's pods go quickly: nothing there is worth a drain


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    requeue_after: float | None  # seconds until time alone can change the plan


@dataclass(frozen=True)
class GroupView:
    record: GroupRecord
    live: tuple[PodState, ...]  # current pods that run or start
    ready: bool
    outdated: bool
    updated: bool  # complete and on the current template


def plan(md: ModelDeployment, observed: Observed, now: datetime,
         config: OperatorConfig) -> Plan:
    if md.deleting:  # the garbage collector removes the children
        return Plan((), None)
    refused = refusals(md.spec, config)
    if refused:
        return _refuse(md, refused, now)
    return _Pass(md, observed, now, config).run()


def _refuse(md: ModelDeployment, refused: tuple[Refusal, ...], now: datetime) -> Plan:
    """A refused spec: an Event and the status say why; nothing is created, changed or
    deleted until the spec changes."""
    first = refused[0]
    message = "; ".join(r.message for r in refused)
    event = builders.build_event(md, f"{md.name}.{md.uid[:8]}.refused-{md.generation}",
                                 "SpecRefused", "Warning", message, now)
    status = {**md.status.raw, "observedGeneration": md.generation, "phase": "Failed",
              "conditions": refused_conditions(first.reason, message, md.status,
                                               md.generation, now)}
    if status == md.status.raw:  # said already
        return Plan((), None)
    return Plan((EmitEvent(event), ReplaceStatus(status)), None)


class _Pass:
    def __init__(self, md: ModelDeployment, observed: Observed, now: datetime,
                 config: OperatorConfig) -> None:
        self.md, self.now, self.config = md, now, config
        self.observed = observed
        self.services = observed.services
        self.pods: dict[str, list[PodState]] = {}
        self.taken = {p.name for p in observed.pods}  # stable names: wait until one is gone
        for pod in observed.pods:
            if pod.owner_uid == md.uid and pod.role in names.SERVER_ROLES:
                self.pods.setdefault(pod.group, []).append(pod)
        self.role = md.spec.colocated  # the role being planned (run() goes through them)
        self.target_hash = ""
        self.restarts_by_reason = Counter(md.status.restarts_by_reason)
        self.events: list[EmitEvent] = []
        self.deletes: list[DeletePods | DeleteRouter | DeleteNetworkPolicy] = []
        self.creates: list[Action] = []
        self.scales: list[ScaleRole] = []
        self.scaling: list[ScalingRecord] = []
        self.waits: list[float] = []

    def run(self) -> Plan:
        self._ensure_services()
        self._ensure_router()
        self._ensure_network_policy()
        kept: list[GroupView] = []
        desired: list[GroupView] = []
        retiring: list[GroupRecord] = []
        for name in names.SERVER_ROLES:
            role = self.md.spec.role(name)
            role_kept, role_retiring = self._plan_role(role)
            role_desired = [v for v in role_kept if v.record.replica < role.replicas]
            kept += role_kept
            desired += role_desired
            retiring += role_retiring
            self._autoscale(role, role_desired)
        refused = self.observed.create_refused if self.creates else ""  # still planned
        if refused:
            self._event(f"{self.md.name}.{self.md.uid[:8]}.create-refused-"
                        f"{hashlib.sha256(refused.encode()).hexdigest()[:12]}",
                        "CreateRefused", refused)
        status = self._status(kept, desired, retiring, refused)
        actions: list[Action] = [*self.events]
        if status != self.md.status.raw:
            actions.append(ReplaceStatus(status))
        actions += [*self.scales, *self.deletes, *self.creates]
        return Plan(tuple(actions), min(self.waits, default=None))

    def _plan_role(self, role: Role) -> tuple[list[GroupView], list[GroupRecord]]:
        """The groups of one role kept (desired and surge), and those retiring."""
        self.role = role
        self.target_hash = builders.template_hash(self.md, self.config, role)
        desired = [self._group(r) for r in range(role.replicas)]
        surge_exists = any(self._replica_of(g) >= role.replicas for g in self._known_groups())
        surge = surge_replicas([self._health(v) for v in desired], surge_exists, role.replicas,
                               self.md.spec.rollout)
        kept = self._roll(desired + [self._group(r) for r in surge])
        return kept, self._retire({v.record.replica for v in kept})

    # -- groups ------------------------------------------------------------------------------

    def _group(self, replica: int) -> GroupView:
        name = names.group_name(self.md.name, self.role.name, replica)
        pods = self.pods.get(name, [])
        record = self._record(name, replica, pods)
        stale = [p for p in pods if p.incarnation < record.incarnation]
        current = [p for p in pods if p.incarnation >= record.incarnation]
        self._delete(name, stale, FAILED_GROUP_GRACE_S, "left from an earlier incarnation")
        if record.failed:
            return self._failed(record, current)
        verdict = judge([p for p in current if not p.terminating], record,
                        self.md.spec.restart_policy, self.now)
        if isinstance(verdict, Restart):
            return self._restart(record, current, verdict)
        if isinstance(verdict, Fail):
            return self._fail(record, current, verdict)
        if isinstance(verdict, Wait):
            self.waits.append(verdict.seconds)
            return self._view(record, current)
        deadline = parse_time(record.recreate_after)
        if deadline is not None and self.now < deadline:
            self.waits.append(seconds_between(self.now, deadline))
            return self._view(record, current, "Restarting")
        if stale:
            return self._view(record, current, "Restarting")
        view = self._view(replace(record, recreate_after=None), current)
        if not view.outdated:
            self._create_missing(view.record, current)
        return view

    def _record(self, name: str, replica: int, pods: list[PodState]) -> GroupRecord:
        """The group's record, reconciled with what its pods and the generation say."""
        record = self.md.status.group(name) or GroupRecord(
            name=name, role=self.role.name, replica=replica, generation=self.md.generation)
        newest = max((p.incarnation for p in pods), default=0)
        if newest > record.incarnation:  # the status was lost or is behind its pods
            record = replace(record, incarnation=newest)
        if record.generation != self.md.generation:  # the restart budget is per spec
            record = replace(record, generation=self.md.generation, generation_restarts=0)
        if record.failed and record.failed_generation != self.md.generation:
            record = replace(record, failed_generation=None, failed_reason=None,
                             recreate_after=None, incarnation=record.incarnation + 1,
                             phase="Pending")  # the spec changed: try again
        return record

    def _view(self, record: GroupRecord, current: list[PodState],
              phase: str | None = None) -> GroupView:
        """The group as its current pods show it; Ready or Pending unless `phase` says."""
        live = tuple(p for p in current if p.live)
        complete = len(live) == self.role.engine.nnodes
        ready = complete and all(p.ready for p in live)
        outdated = any(p.template_hash != self.target_hash for p in live)
        record = record.with_phase(phase or ("Ready" if ready else "Pending"))
        return GroupView(record, live, ready, outdated, complete and not outdated)

    def _restart(self, record: GroupRecord, current: list[PodState],
                 verdict: Restart) -> GroupView:
        ending = verdict.ending
        record = replace(
            record, phase="Restarting", restarts=record.restarts + 1,
            generation_restarts=record.generation_restarts + 1,
            incarnation=record.incarnation + 1, last_restart_reason=ending.reason,
            last_restart_time=format_time(self.now), last_termination=ending,
            recreate_after=format_deadline(self.now + timedelta(seconds=verdict.delay_s)))
        self.restarts_by_reason[ending.reason] += 1
        budget = self.md.spec.restart_policy.max_group_restarts
        self._event(f"{record.name}.{self.md.uid[:8]}.restart-{record.incarnation}",
                    "GroupRestart",
                    f"group {record.name} is recreated in {verdict.delay_s}s (restart "
                    f"{record.generation_restarts} of {budget} allowed): {ending.describe()}")
        self._delete(record.name, [p for p in current if not p.terminating],
                     FAILED_GROUP_GRACE_S, f"group restart: {ending.reason}")
        self.waits.append(float(verdict.delay_s))
        return GroupView(record, (), False, False, False)

    def _fail(self, record: GroupRecord, current: list[PodState], verdict: Fail) -> GroupView:
        record = replace(record, phase="Failed", failed_generation=self.md.generation,
                         failed_reason=verdict.cause, last_termination=verdict.ending,
                         recreate_after=None)
        self._event(f"{record.name}.{self.md.uid[:8]}.failed-{record.incarnation}",
                    "GroupFailed",
                    f"group {record.name} failed ({verdict.cause}) and stays down until the "
                    f"spec changes: {verdict.ending.describe()}")
        return self._failed(record, current)

    def _failed(self, record: GroupRecord, current: list[PodState]) -> GroupView:
        """A Failed group keeps its ended pods (their logs), and stops the others."""
        self._delete(record.name, [p for p in current if p.live], FAILED_GROUP_GRACE_S,
                     f"group failed: {record.failed_reason}")
        return GroupView(record.with_phase("Failed"), (), False, False, False)

    def _create_missing(self, record: GroupRecord, current: list[PodState]) -> None:
        present = {p.node_rank for p in current}
        pods = tuple(
            builders.build_pod(self.md, self.config, record.replica, rank, record.incarnation,
                               self.target_hash, self.role)
            for rank in range(self.role.engine.nnodes)
            if rank not in present and names.pod_name(self.md.name, self.role.name,
                                                      record.replica, rank) not in self.taken)
        if pods:
            self.creates.append(CreatePods(record.name, pods))

    # -- rollout and scale -------------------------------------------------------------------

    def _health(self, view: GroupView) -> GroupHealth:
        settled = view.record.failed or (view.ready and view.updated)
        return GroupHealth(view.record.replica, view.ready, view.outdated, settled)

    def _roll(self, kept: list[GroupView]) -> list[GroupView]:
        """Delete the outdated groups the rollout allows now, in its order."""
        chosen = groups_to_replace([self._health(v) for v in kept], self.role.replicas,
                                   self.md.spec.rollout)
        views = {v.record.replica: v for v in kept}
        for replica in chosen:
            view = views[replica]
            self._delete(view.record.name, list(view.live), None, "rolling to a new template")
            views[replica] = GroupView(view.record.with_phase("Pending"), (), False, False, False)
        return [views[v.record.replica] for v in kept]

    def _known_groups(self) -> set[str]:
        """The groups of the role being planned, by their pods or their records."""
        return ({g for g, pods in self.pods.items() if pods[0].role == self.role.name}
                | {g.name for g in self.md.status.groups if g.role == self.role.name})

    def _replica_of(self, group: str) -> int:
        record = self.md.status.group(group)
        if record is not None:
            return record.replica
        return self.pods[group][0].replica

    def _retire(self, kept: set[int]) -> list[GroupRecord]:
        """Groups beyond what is wanted go, highest replica first; each stays in the status as
        Terminating until its last pod is gone."""
        retiring = []
        for name in sorted(self._known_groups(), key=self._replica_of, reverse=True):
            replica = self._replica_of(name)
            if replica in kept:
                continue
            pods = self.pods.get(name, [])
            self._delete(name, pods, None, "scaled down")
            if pods:
                record = self.md.status.group(name) or GroupRecord(
                    name=name, role=self.role.name, replica=replica)
                retiring.append(record.with_phase("Terminating"))
        return retiring

    def _autoscale(self, role: Role, desired: list[GroupView]) -> None:
        """With the role's autoscaling: decide its replicas from its groups' signals; a change
        is written to the spec (then planned by the next pass) with an Event."""
        rules = role.autoscaling
        if rules is None:
            return
        groups = [GroupSignal(v.record.name, v.ready, v.record.failed,
                              self.observed.signal(v.record.name, rules.metric))
                  for v in desired]
        decision = decide(rules, self.md.status.scaling_of(role.name), role.replicas, groups,
                          self.now)
        self.scaling.append(decision.record)
        self.waits.append(self.config.autoscaling_interval_s)
        if decision.replicas != role.replicas:
            self.scales.append(ScaleRole(role.name, decision.replicas))
            stamp = self.now.strftime("%Y%m%d%H%M%S")
            self._event(f"{self.md.name}.{self.md.uid[:8]}.scale-{role.name}-{stamp}", "Scaled",
                        f"{role.name} groups {role.replicas} -> {decision.replicas}: "
                        f"{decision.reason}", "Normal")

    # -- status ------------------------------------------------------------------------------

    def _status(self, kept: list[GroupView], desired: list[GroupView],
                retiring: list[GroupRecord], create_refused: str) -> dict[str, Any]:
        spec, md = self.md.spec, self.md
        failed = tuple(v.record for v in desired if v.record.failed)
        settled = (all(self._health(v).settled for v in desired) and len(kept) == len(desired)
                   and not retiring)
        summary = Summary(
            replicas=sum(r.replicas for r in spec.roles()), ready=sum(v.ready for v in kept),
            max_unavailable=spec.rollout.max_unavailable, failed=failed, settled=settled,
            progress=_progress(kept, desired, retiring),
            create_refused=create_refused)
        endpoint = names.router_name(md.name) if spec.router else names.service_name(md.name)
        return {
            "observedGeneration": md.generation,
            "phase": phase(summary),
            "replicas": sum(bool(v.live) for v in kept),
            "readyReplicas": summary.ready,
            "updatedReplicas": sum(v.updated for v in kept),
            "restarts": sum(self.restarts_by_reason.values()),
            "restartsByReason": dict(sorted(self.restarts_by_reason.items())),
            "selector": builders.selector_string(builders.serving_selector(md.name)),
            "endpoint": f"{names.service_host(endpoint, md.namespace, self.config.cluster_domain)}"
                        f":{names.HTTP_PORT}",
            "groups": [v.record.to_dict() for v in kept] + [r.to_dict() for r in retiring],
            "conditions": conditions(summary, md.status, md.generation, self.now),
        } | ({"autoscaling": [r.to_dict() for r in self.scaling]} if self.scaling else {})

    # -- actions -----------------------------------------------------------------------------

    def _ensure_services(self) -> None:
        services = [builders.build_headless_service(self.md, r.name)
                    for r in self.md.spec.roles()]
        services.append(builders.build_service(self.md))
        if self.md.spec.router:
            services.append(builders.build_router_service(self.md))
        for service in services:
            if service["metadata"]["name"] not in self.services:
                self.creates.append(CreateService(service))

    def _ensure_router(self) -> None:
        """The router's Deployment as the spec says (created, or patched when its template
        hash changed), or, without spec.router, no router."""
        name = names.router_name(self.md.name)
        stored = self.observed.deployment_hash(name)
        if self.md.spec.router is None:
            if stored is not None or name in self.services:
                self.deletes.append(DeleteRouter(name))
            return
        deployment = builders.build_router_deployment(self.md, self.config)
        if stored is None:
            self.creates.append(CreateDeployment(deployment))
        elif stored != deployment["metadata"]["labels"][names.TEMPLATE_HASH]:
            self.creates.append(PatchDeployment(deployment))

    def _ensure_network_policy(self) -> None:
        name = names.network_policy_name(self.md.name)
        stored = self.observed.network_policy_hash(name)
        if not self.md.spec.network_policy.enabled:
            if stored is not None:
                self.deletes.append(DeleteNetworkPolicy(name))
            return
        policy = builders.build_network_policy(self.md)
        if stored != policy["metadata"]["labels"][names.TEMPLATE_HASH]:
            self.creates.append(ApplyNetworkPolicy(policy, exists=stored is not None))

    def _delete(self, group: str, pods: list[PodState], grace: int | None, why: str) -> None:
        gone = tuple(PodRef(p.name, p.uid) for p in pods if not p.terminating)
        if gone:
            self.deletes.append(DeletePods(group, gone, grace, why))

    def _event(self, name: str, reason: str, message: str, kind: str = "Warning") -> None:
        self.events.append(EmitEvent(builders.build_event(self.md, name, reason, kind,
                                                          message, self.now)))


def _progress(kept: list[GroupView], desired: list[GroupView], retiring: list[GroupRecord]) -> str:
    """Why the resource is not settled, for the Progressing condition."""
    if any(v.record.phase == "Restarting" for v in desired):
        return "GroupRestarting"
    if any(v.outdated for v in desired) or len(kept) > len(desired):
        return "RollingUpdate"
    if retiring:
        return "ScalingDown"
    return "GroupsStarting"
