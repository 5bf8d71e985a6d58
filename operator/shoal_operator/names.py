"""The names the operator hands out and reads back: resource coordinates, labels, object names."""

from __future__ import annotations

GROUP = "shoal.dev"
VERSION = "v1alpha1"
PLURAL = "modeldeployments"
KIND = "ModelDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

OPERATOR = "shoal-operator"
CONTAINER = "engine"
HTTP_PORT = 30000  # the engine's --port: OpenAI API on node 0, the node health endpoint elsewhere
DIST_INIT_PORT = 29500  # the rendezvous port on node 0 of a multi-node group
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
MODEL_MOUNT_PATH = "/models"
SCRATCH_MOUNT_PATH = "/tmp"  # an emptyDir: the only place a container writes (read-only root)
IMAGE_UID = 10001  # the image's user and group (Dockerfile: USER 10001:10001)
API_KEY_ENV = "SHOAL_API_KEY"  # read by `shoal serve` and `shoal router`

NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
MANAGED_BY = "app.kubernetes.io/managed-by"
COMPONENT = "app.kubernetes.io/component"
GROUP_LABEL = "shoal.dev/group"
REPLICA = "shoal.dev/replica"
NODE_RANK = "shoal.dev/node-rank"
TEMPLATE_HASH = "shoal.dev/template-hash"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # the apiserver sets it on each namespace
INCARNATION = "shoal.dev/incarnation"  # which life of its group a pod belongs to (status.groups)

ENGINE_ROLE = "engine"  # a colocated server's pods
PREFILL_ROLE = "prefill"
DECODE_ROLE = "decode"
SERVER_ROLES = (ENGINE_ROLE, PREFILL_ROLE, DECODE_ROLE)
ROUTER_ROLE = "router"
ROUTER_CONTAINER = "router"


def common_labels(md_name: str) -> dict[str, str]:
    return {NAME: "shoal", INSTANCE: md_name, MANAGED_BY: OPERATOR}


def group_name(md_name: str, role: str, replica: int) -> str:
    """`<md>-<replica>` for colocated engine groups (`<md>-<role>-<replica>` for other roles)."""
    if role == ENGINE_ROLE:
        return f"{md_name}-{replica}"
    return f"{md_name}-{role}-{replica}"


def pod_name(md_name: str, role: str, replica: int, node_rank: int) -> str:
    return f"{group_name(md_name, role, replica)}-{node_rank}"


def headless_service_name(md_name: str, role: str = ENGINE_ROLE) -> str:
    """The pods' subdomain: `<pod>.<md>-nodes.<ns>.svc.<domain>` resolves to each pod
    (`<md>-<role>-nodes` for prefill and decode pods)."""
    if role == ENGINE_ROLE:
        return f"{md_name}-nodes"
    return f"{md_name}-{role}-nodes"


def service_name(md_name: str) -> str:
    """The ClusterIP Service in front of node 0 of every group: `status.endpoint`."""
    return md_name


def router_name(md_name: str) -> str:
    """The router's Deployment and its ClusterIP Service (then `status.endpoint`)."""
    return f"{md_name}-router"


def network_policy_name(md_name: str) -> str:
    """The NetworkPolicy in front of the engine pods (spec.networkPolicy.enabled)."""
    return f"{md_name}-engines"


def service_host(service: str, namespace: str, cluster_domain: str) -> str:
    return f"{service}.{namespace}.svc.{cluster_domain}"


def pod_host(md_name: str, namespace: str, pod: str, cluster_domain: str,
             role: str = ENGINE_ROLE) -> str:
    return f"{pod}.{headless_service_name(md_name, role)}.{namespace}.svc.{cluster_domain}"
