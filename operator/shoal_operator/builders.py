"""The objects the operator creates: pods of a group, the Services, the router's Deployment,
the NetworkPolicy, Events. Pure.

Every pod passes the `restricted` Pod Security profile as built: the image's non-root user, no
privilege escalation, no capabilities, the RuntimeDefault seccomp profile, a read-only root
filesystem with an emptyDir at /tmp (the engine's run dir and caches) and a memory-backed
/dev/shm. A `podTemplate.securityContext` is merged over the pod-level defaults.

A group's pods share one template; `template_hash` fingerprints it (everything that defines a
pod: image, model, engine flags and env, resources, scheduling fields), and a pod whose hash
differs from the current one is rolled.
"""

from __future__ import annotations

import copy
import hashlib
import json
from datetime import datetime
from typing import Any

from shoal_operator import names
from shoal_operator.config import OperatorConfig
from shoal_operator.spec import NVIDIA_GPU, Engine, ModelDeployment, Role
from shoal_operator.status import format_time

READINESS_PERIOD_S = 3
DEFAULT_GRACE_S = 130  # above the engine's 120 s drain (docs/image.md)
POD_TEMPLATE_FIELDS = ("nodeSelector", "tolerations", "affinity", "priorityClassName",
                       "securityContext", "terminationGracePeriodSeconds")
POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True, "runAsUser": names.IMAGE_UID, "runAsGroup": names.IMAGE_UID,
    "fsGroup": names.IMAGE_UID, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]}}
SCRATCH_VOLUME = {"name": "tmp", "emptyDir": {}}
SCRATCH_MOUNT = {"name": "tmp", "mountPath": names.SCRATCH_MOUNT_PATH}


def owner_reference(md: ModelDeployment) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": md.name,
            "uid": md.uid, "controller": True, "blockOwnerDeletion": True}


def _metadata(md: ModelDeployment, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": md.namespace, "labels": labels,
            "ownerReferences": [owner_reference(md)]}


def engine_env(md: ModelDeployment, config: OperatorConfig, replica: int, node_rank: int,
               role: Role | None = None) -> list[dict[str, Any]]:
    """The operator's SHOAL_* variables (docs/kubernetes.md), then the user's `engine.env`; a
    user variable of the same name replaces the operator's."""
    role = role or md.spec.colocated
    engine = role.engine
    mode = "null" if role.name == names.ENGINE_ROLE else role.name
    values = {"SHOAL_PORT": str(names.HTTP_PORT), "SHOAL_TP": str(engine.tp),
              "SHOAL_PP": str(engine.pp), "SHOAL_NNODES": str(engine.nnodes),
              "SHOAL_NODE_RANK": str(node_rank), "SHOAL_DISAGGREGATION_MODE": mode,
              "SHOAL_TERMINATION_LOG": names.TERMINATION_MESSAGE_PATH}
    if engine.nnodes > 1:  # a one-node group picks its own local rendezvous port
        leader = names.pod_name(md.name, role.name, replica, 0)
        host = names.pod_host(md.name, md.namespace, leader, config.cluster_domain, role.name)
        values["SHOAL_DIST_INIT_ADDR"] = f"{host}:{names.DIST_INIT_PORT}"
    if engine.accelerator == NVIDIA_GPU:
        values["SHOAL_DEVICE"] = "cuda"
    if role.autoscaling is not None:  # its signals are read from /metrics
        values["SHOAL_ENABLE_METRICS"] = "true"
    if md.spec.model.path:
        values["SHOAL_MODEL_PATH"] = md.spec.model.path
    if md.spec.model.served_name:
        values["SHOAL_SERVED_MODEL_NAME"] = md.spec.model.served_name
    env: list[dict[str, Any]] = [
        {"name": "SHOAL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    env += [{"name": k, "value": v} for k, v in values.items()]
    env += api_key_env(md)
    user = {e["name"]: e for e in engine.env}
    merged = [user.pop(e["name"], e) for e in env]
    return merged + list(user.values())


def api_key_env(md: ModelDeployment) -> list[dict[str, Any]]:
    """SHOAL_API_KEY from the Secret `spec.auth.apiKeySecretRef` names: the pod spec holds the
    reference only, the kubelet reads the value (the operator may not read Secrets)."""
    ref = md.spec.api_key_secret
    if ref is None:
        return []
    return [{"name": names.API_KEY_ENV,
             "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def _volumes(md: ModelDeployment) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}},
                                     copy.deepcopy(SCRATCH_VOLUME)]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"},
                                    copy.deepcopy(SCRATCH_MOUNT)]
    if md.spec.model.volume:
        volumes.append({"name": "model", **md.spec.model.volume})
        mounts.append({"name": "model", "mountPath": names.MODEL_MOUNT_PATH, "readOnly": True})
    return volumes, mounts


def engine_resources(engine: Engine) -> dict[str, Any]:
    """The engine container's resources as given; on GPUs, one `nvidia.com/gpu` per rank of the
    pod in its limits (extended resources are requested as they are limited)."""
    if engine.accelerator != NVIDIA_GPU:
        return engine.resources
    resources = copy.deepcopy(engine.resources)
    resources.setdefault("limits", {})[NVIDIA_GPU] = engine.ranks_per_pod
    return resources


def pod_spec(md: ModelDeployment, config: OperatorConfig, replica: int, node_rank: int,
             role: Role | None = None) -> dict[str, Any]:
    role = role or md.spec.colocated
    name = names.pod_name(md.name, role.name, replica, node_rank)
    ports = [{"name": "http", "containerPort": names.HTTP_PORT}]
    if role.engine.nnodes > 1:
        ports.append({"name": "dist", "containerPort": names.DIST_INIT_PORT})
    volumes, mounts = _volumes(md)
    container = {
        "name": names.CONTAINER, "image": md.spec.image, "args": list(md.spec.engine.args),
        "env": engine_env(md, config, replica, node_rank, role), "ports": ports,
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"},
                           "periodSeconds": READINESS_PERIOD_S, "timeoutSeconds": 2},
        "resources": engine_resources(role.engine), "volumeMounts": mounts,
        "terminationMessagePath": names.TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never", "hostname": name,
        "subdomain": names.headless_service_name(md.name, role.name),
        "automountServiceAccountToken": False, "enableServiceLinks": False,
        "terminationGracePeriodSeconds": DEFAULT_GRACE_S,
        "containers": [container], "volumes": volumes,
    }
    spec.update(_pod_template_fields(md))
    return spec


def _pod_template_fields(md: ModelDeployment) -> dict[str, Any]:
    """`spec.podTemplate`'s fields; its securityContext merged over the restricted defaults."""
    fields = {k: md.spec.pod_template[k] for k in POD_TEMPLATE_FIELDS
              if md.spec.pod_template.get(k) is not None}
    fields["securityContext"] = {**copy.deepcopy(POD_SECURITY_CONTEXT),
                                 **fields.get("securityContext", {})}
    return fields


def _fingerprint(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def template_hash(md: ModelDeployment, config: OperatorConfig, role: Role | None = None) -> str:
    """Fingerprint of a role's pod template (as built for replica 0, node 0; the same for
    all)."""
    return _fingerprint(pod_spec(md, config, 0, 0, role))


def pod_labels(md: ModelDeployment, replica: int, node_rank: int, incarnation: int,
               hash_: str, role: str = names.ENGINE_ROLE) -> dict[str, str]:
    return {**names.common_labels(md.name), names.COMPONENT: role,
            names.GROUP_LABEL: names.group_name(md.name, role, replica),
            names.REPLICA: str(replica), names.NODE_RANK: str(node_rank),
            names.INCARNATION: str(incarnation), names.TEMPLATE_HASH: hash_}


def build_pod(md: ModelDeployment, config: OperatorConfig, replica: int, node_rank: int,
              incarnation: int, hash_: str, role: Role | None = None) -> dict[str, Any]:
    role = role or md.spec.colocated
    name = names.pod_name(md.name, role.name, replica, node_rank)
    labels = pod_labels(md, replica, node_rank, incarnation, hash_, role.name)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": _metadata(md, name, labels),
            "spec": pod_spec(md, config, replica, node_rank, role)}


def engine_selector(md_name: str, role: str = names.ENGINE_ROLE) -> dict[str, str]:
    return {**names.common_labels(md_name), names.COMPONENT: role}


def serving_selector(md_name: str) -> dict[str, str]:
    """Node 0 of every group: the pod that serves the OpenAI API."""
    return {**engine_selector(md_name), names.NODE_RANK: "0"}


def selector_string(selector: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


def build_headless_service(md: ModelDeployment, role: str = names.ENGINE_ROLE) -> dict[str, Any]:
    """Every pod's DNS name of a role, ready or not (ranks find each other before they are;
    the router finds the servers)."""
    ports = [{"name": "http", "port": names.HTTP_PORT, "targetPort": "http"},
             {"name": "dist", "port": names.DIST_INIT_PORT, "targetPort": names.DIST_INIT_PORT}]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _metadata(md, names.headless_service_name(md.name, role),
                                  names.common_labels(md.name)),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": engine_selector(md.name, role), "ports": ports}}


def build_service(md: ModelDeployment) -> dict[str, Any]:
    """The ClusterIP Service in front of the ready groups' node-0 pods (node 0's /health is 200
    only once every rank of its group has joined)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _metadata(md, names.service_name(md.name), names.common_labels(md.name)),
            "spec": {"type": "ClusterIP", "selector": serving_selector(md.name),
                     "ports": [{"name": "http", "port": names.HTTP_PORT, "targetPort": "http"}]}}


def router_args(md: ModelDeployment, config: OperatorConfig) -> list[str]:
    """`shoal router` over the servers of the headless Services of the roles the spec runs
    (each server's mode from its /server_info)."""
    assert md.spec.router is not None
    args = ["router", "--host", "$(POD_IP)", "--port", str(names.HTTP_PORT),
            "--policy", md.spec.router.policy]
    for role in md.spec.roles():
        host = names.service_host(names.headless_service_name(md.name, role.name),
                                  md.namespace, config.cluster_domain)
        args += ["--service", f"{host}:{names.HTTP_PORT}"]
    return args


def build_router_deployment(md: ModelDeployment, config: OperatorConfig) -> dict[str, Any]:
    """The router's Deployment; its `shoal.dev/template-hash` label fingerprints the rest, so a
    changed spec replaces it."""
    assert md.spec.router is not None
    selector = engine_selector(md.name, names.ROUTER_ROLE)
    container = {
        "name": names.ROUTER_CONTAINER, "image": md.spec.image,
        "command": ["shoal"], "args": router_args(md, config),
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                *api_key_env(md)],
        "ports": [{"name": "http", "containerPort": names.HTTP_PORT}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"},
                           "periodSeconds": READINESS_PERIOD_S, "timeoutSeconds": 2},
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
        "volumeMounts": [copy.deepcopy(SCRATCH_MOUNT)],
    }
    pod_spec_: dict[str, Any] = {"automountServiceAccountToken": False,
                                 "enableServiceLinks": False, "containers": [container],
                                 "volumes": [copy.deepcopy(SCRATCH_VOLUME)],
                                 **_pod_template_fields(md)}
    spec = {"replicas": md.spec.router.replicas, "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": selector}, "spec": pod_spec_}}
    labels = {**selector, names.TEMPLATE_HASH: _fingerprint(spec)}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _metadata(md, names.router_name(md.name), labels), "spec": spec}


def build_router_service(md: ModelDeployment) -> dict[str, Any]:
    """The ClusterIP Service in front of the ready routers: `status.endpoint` with a router."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _metadata(md, names.router_name(md.name), names.common_labels(md.name)),
            "spec": {"type": "ClusterIP",
                     "selector": engine_selector(md.name, names.ROUTER_ROLE),
                     "ports": [{"name": "http", "port": names.HTTP_PORT, "targetPort": "http"}]}}


def build_network_policy(md: ModelDeployment) -> dict[str, Any]:
    """Ingress to the engine pods (every server role) from the ModelDeployment's own pods (its
    ranks' rendezvous and KV transfer, its router) and from the pods of
    `spec.networkPolicy.clientNamespaces`, on any port (the transfer ports are picked at run
    time); nothing else. Its `shoal.dev/template-hash` label fingerprints the spec."""
    peers: list[dict[str, Any]] = [{"podSelector": {"matchLabels": names.common_labels(md.name)}}]
    clients = md.spec.network_policy.client_namespaces
    if clients:
        peers.append({"namespaceSelector": {"matchExpressions": [
            {"key": names.NAMESPACE_NAME_LABEL, "operator": "In", "values": list(clients)}]}})
    spec = {"podSelector": {"matchLabels": names.common_labels(md.name),
                            "matchExpressions": [{"key": names.COMPONENT, "operator": "In",
                                                  "values": list(names.SERVER_ROLES)}]},
            "policyTypes": ["Ingress"], "ingress": [{"from": peers}]}
    labels = {**names.common_labels(md.name), names.TEMPLATE_HASH: _fingerprint(spec)}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _metadata(md, names.network_policy_name(md.name), labels),
            "spec": spec}


def build_event(md: ModelDeployment, name: str, reason: str, event_type: str, message: str,
                now: datetime) -> dict[str, Any]:
    stamp = format_time(now)
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": md.namespace},
            "involvedObject": {"apiVersion": names.API_VERSION, "kind": names.KIND,
                               "name": md.name, "namespace": md.namespace, "uid": md.uid},
            "reason": reason, "message": message[:1024], "type": event_type,
            "source": {"component": names.OPERATOR}, "firstTimestamp": stamp,
            "lastTimestamp": stamp, "count": 1}
