"""A ModelDeployment as the operator reads it: the spec with every default applied. Pure.

The CRD (helm/shoal/crds/) applies the same defaults in the apiserver; applying them here too
keeps the planner independent of how the object was stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from shoal.lifecycle import Reason
from shoal_operator import names
from shoal_operator.status import RecordedStatus

RECREATABLE = (Reason.WATCHDOG, Reason.CONSENSUS, Reason.PEER_LOST, Reason.CRASH, Reason.OOM)


@dataclass(frozen=True)
class Backoff:
    initial_s: int = 10
    max_s: int = 300

    def delay_s(self, restart: int) -> int:
        """Seconds before the `restart`-th recreation (1-based): initial, doubling, capped."""
        return min(self.max_s, self.initial_s * (1 << max(0, restart - 1)))


@dataclass(frozen=True)
class RestartPolicy:
    recreate_on: frozenset[Reason] = frozenset(RECREATABLE)
    max_group_restarts: int = 10
    backoff: Backoff = Backoff()


@dataclass(frozen=True)
class Rollout:
    max_unavailable: int = 1
    max_surge: int = 0


CPU, NVIDIA_GPU = "cpu", "nvidia.com/gpu"  # spec.engine.accelerator


@dataclass(frozen=True)
class Engine:
    tp: int = 1
    pp: int = 1
    nnodes: int = 1
    args: tuple[str, ...] = ()
    env: tuple[dict[str, Any], ...] = ()  # Kubernetes EnvVar objects, as given
    resources: dict[str, Any] = field(default_factory=dict)
    accelerator: str = CPU  # or NVIDIA_GPU: each rank on a GPU of its own

    @property
    def ranks_per_pod(self) -> int:
        return self.tp * self.pp // self.nnodes


@dataclass(frozen=True)
class Model:
    path: str | None = None
    served_name: str | None = None
    volume: dict[str, Any] | None = None  # {persistentVolumeClaim: ...} or {hostPath: ...}


QUEUED_REQUESTS, RUNNING_REQUESTS, KV_CACHE_USAGE = "queuedRequests", "runningRequests", \
    "kvCacheUsage"
SIGNALS = (QUEUED_REQUESTS, RUNNING_REQUESTS, KV_CACHE_USAGE)


@dataclass(frozen=True)
class ScalingRules:
    """One direction of `autoscaling.behavior` (as the HPA's): a recommendation must hold for
    the whole window before it is followed, and at most `max_groups` groups are added (or
    removed) within any `period_s`."""

    stabilization_window_s: int
    max_groups: int
    period_s: int


@dataclass(frozen=True)
class Autoscaling:
    """A role's replicas follow the average of `metric` over its Ready groups, aiming at
    `target` per group."""

    min_replicas: int
    max_replicas: int
    metric: str  # one of SIGNALS
    target: float
    scale_up: ScalingRules = ScalingRules(0, 4, 15)
    scale_down: ScalingRules = ScalingRules(300, 1, 60)


@dataclass(frozen=True)
class Role:
    """One kind of group: colocated servers (`engine`: spec.engine, spec.replicas,
    spec.autoscaling), or the prefill or decode servers of spec.disaggregation (spec.engine's
    args and env, the role's own replicas, tp, pp, nnodes, resources and autoscaling)."""

    name: str
    replicas: int
    engine: Engine
    autoscaling: Autoscaling | None = None


@dataclass(frozen=True)
class Router:
    replicas: int = 1
    policy: str = "cache_aware"


@dataclass(frozen=True)
class SecretKeyRef:
    """A key of a Secret in the ModelDeployment's namespace; the kubelet reads it, not the
    operator."""

    name: str
    key: str


@dataclass(frozen=True)
class NetworkPolicy:
    enabled: bool = False
    client_namespaces: tuple[str, ...] = ()  # namespaces whose pods may reach the engines


@dataclass(frozen=True)
class Spec:
    image: str
    model: Model = Model()
    engine: Engine = Engine()
    replicas: int = 1
    restart_policy: RestartPolicy = RestartPolicy()
    rollout: Rollout = Rollout()
    pod_template: dict[str, Any] = field(default_factory=dict)
    disaggregation: tuple[Role, Role] | None = None  # prefill, decode
    router: Router | None = None
    api_key_secret: SecretKeyRef | None = None  # spec.auth.apiKeySecretRef
    network_policy: NetworkPolicy = NetworkPolicy()
    autoscaling: Autoscaling | None = None  # of the colocated groups

    @property
    def colocated(self) -> Role:
        return Role(names.ENGINE_ROLE, self.replicas, self.engine, self.autoscaling)

    def roles(self) -> tuple[Role, ...]:
        """The groups to run: prefill and decode groups when disaggregated (then no colocated
        ones), else colocated groups."""
        return self.disaggregation or (self.colocated,)

    def role(self, name: str) -> Role:
        """A role by name; one the spec does not run has no replicas."""
        found = {r.name: r for r in self.roles()}
        return found.get(name) or Role(name, 0, self.engine)


@dataclass(frozen=True)
class ModelDeployment:
    name: str
    namespace: str
    uid: str
    generation: int
    resource_version: str
    deleting: bool
    spec: Spec
    status: RecordedStatus

    @classmethod
    def from_body(cls, body: dict[str, Any], default_image: str) -> ModelDeployment:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"],
                   generation=int(meta.get("generation", 1)),
                   resource_version=meta.get("resourceVersion", ""),
                   deleting=bool(meta.get("deletionTimestamp")),
                   spec=parse_spec(body.get("spec") or {}, default_image),
                   status=RecordedStatus.from_dict(body.get("status") or {}))


def parse_spec(raw: dict[str, Any], default_image: str) -> Spec:
    model = raw.get("model") or {}
    engine = raw.get("engine") or {}
    policy = raw.get("restartPolicy") or {}
    backoff = policy.get("backoff") or {}
    rollout = raw.get("rollout") or {}
    defaults = RestartPolicy()
    engine_spec = Engine(tp=int(engine.get("tp", 1)), pp=int(engine.get("pp", 1)),
                         nnodes=int(engine.get("nnodes", 1)),
                         args=tuple(str(a) for a in engine.get("args") or ()),
                         env=tuple(engine.get("env") or ()),
                         resources=dict(engine.get("resources") or {}),
                         accelerator=str(engine.get("accelerator", CPU)))
    return Spec(
        image=raw.get("image") or default_image,
        model=Model(path=model.get("path"), served_name=model.get("servedName"),
                    volume=model.get("volume")),
        engine=engine_spec,
        replicas=int(raw.get("replicas", 1)),
        restart_policy=RestartPolicy(
            recreate_on=frozenset(Reason(r) for r in policy.get("recreateGroupOn", RECREATABLE)),
            max_group_restarts=int(policy.get("maxGroupRestarts", defaults.max_group_restarts)),
            backoff=Backoff(initial_s=int(backoff.get("initialSeconds", Backoff.initial_s)),
                            max_s=int(backoff.get("maxSeconds", Backoff.max_s)))),
        rollout=Rollout(max_unavailable=int(rollout.get("maxUnavailable", 1)),
                        max_surge=int(rollout.get("maxSurge", 0))),
        pod_template=dict(raw.get("podTemplate") or {}),
        disaggregation=_disaggregation(raw.get("disaggregation"), engine_spec),
        router=_router(raw.get("router")),
        api_key_secret=_secret_ref((raw.get("auth") or {}).get("apiKeySecretRef")),
        network_policy=_network_policy(raw.get("networkPolicy") or {}),
        autoscaling=_autoscaling(raw.get("autoscaling"), "spec.autoscaling", QUEUED_REQUESTS),
    )


def _disaggregation(raw: dict[str, Any] | None, engine: Engine) -> tuple[Role, Role] | None:
    if raw is None:
        return None

    def role(name: str) -> Role:
        given = raw.get(name) or {}
        return Role(name, int(given.get("replicas", 1)), replace(
            engine, tp=int(given.get("tp", 1)), pp=int(given.get("pp", 1)),
            nnodes=int(given.get("nnodes", 1)), resources=dict(given.get("resources") or {})),
            _autoscaling(given.get("autoscaling"), f"spec.disaggregation.{name}.autoscaling",
                         DEFAULT_ROLE_SIGNAL[name]))
    return role(names.PREFILL_ROLE), role(names.DECODE_ROLE)


DEFAULT_ROLE_SIGNAL = {names.PREFILL_ROLE: QUEUED_REQUESTS, names.DECODE_ROLE: KV_CACHE_USAGE}


def _autoscaling(raw: dict[str, Any] | None, where: str, default_metric: str) -> Autoscaling | None:
    """The block as the CRD validates it; a bad value raises ValueError naming the field (for
    an object stored before the CRD checked it)."""
    if raw is None:
        return None
    behavior = raw.get("behavior") or {}
    scaling = Autoscaling(
        min_replicas=int(raw.get("minReplicas", 1)), max_replicas=int(raw["maxReplicas"]),
        metric=str(raw.get("metric", default_metric)), target=float(raw["target"]),
        scale_up=_rules(behavior.get("scaleUp") or {}, Autoscaling.scale_up),
        scale_down=_rules(behavior.get("scaleDown") or {}, Autoscaling.scale_down))
    if scaling.metric not in SIGNALS:
        raise ValueError(f"{where}.metric: {scaling.metric!r} is not one of {SIGNALS}")
    if not 1 <= scaling.min_replicas <= scaling.max_replicas:
        raise ValueError(f"{where}: need 1 <= minReplicas <= maxReplicas")
    if scaling.target <= 0:
        raise ValueError(f"{where}.target: must be > 0")
    return scaling


def _rules(raw: dict[str, Any], default: ScalingRules) -> ScalingRules:
    return ScalingRules(
        stabilization_window_s=int(raw.get("stabilizationWindowSeconds",
                                           default.stabilization_window_s)),
        max_groups=int(raw.get("maxGroups", default.max_groups)),
        period_s=int(raw.get("periodSeconds", default.period_s)))


def _router(raw: dict[str, Any] | None) -> Router | None:
    if raw is None:
        return None
    return Router(replicas=int(raw.get("replicas", 1)),
                  policy=str(raw.get("policy", Router.policy)))


def _secret_ref(raw: dict[str, Any] | None) -> SecretKeyRef | None:
    if raw is None:
        return None
    return SecretKeyRef(name=str(raw["name"]), key=str(raw["key"]))


def _network_policy(raw: dict[str, Any]) -> NetworkPolicy:
    return NetworkPolicy(enabled=bool(raw.get("enabled", False)),
                         client_namespaces=tuple(str(n) for n in
                                                 raw.get("clientNamespaces") or ()))
