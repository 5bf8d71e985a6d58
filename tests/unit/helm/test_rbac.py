"""The chart's RBAC is exactly what the operator calls: the Kubernetes client calls of
shoal_operator.kube, kopf's own (watch what its handlers name, patch its finalizer onto what its
daemons run for), plus modeldeployments/finalizers for the owner references it sets; never Secrets,
never a wildcard."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from shoal_operator import names

from tests.support.helm import (
    CI_VALUES,
    LEADER_ELECTION_PERMISSIONS,
    NAMESPACE,
    OPERATOR_PERMISSIONS,
    REPO,
    find,
    only,
    render,
    rule_permissions,
)

OPERATOR = REPO / "operator" / "shoal_operator"
CLIENT_VERBS = {"get": "get", "read": "get", "list": "list", "create": "create",
                "replace": "update", "patch": "patch", "delete": "delete"}
CLIENT_RESOURCES = {"custom_object": (names.GROUP, names.PLURAL),
                    "custom_object_status": (names.GROUP, f"{names.PLURAL}/status"),
                    "custom_object_scale": (names.GROUP, f"{names.PLURAL}/scale"),
                    "pod": ("", "pods"), "service": ("", "services"), "event": ("", "events"),
                    "deployment": ("apps", "deployments"),
                    "network_policy": ("networking.k8s.io", "networkpolicies"),
                    "lease": ("coordination.k8s.io", "leases")}
# kopf handlers that keep state on their resource: a finalizer (and annotations) it patches
STATEFUL_HANDLERS = {"daemon", "timer", "create", "update", "delete", "resume", "field"}
OWNER_REFERENCES = (names.GROUP, f"{names.PLURAL}/finalizers", "update")


def _client_calls() -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every `<verb>_namespaced_<resource>(` call in kube.py."""
    calls = re.findall(r"\.(\w+?)_namespaced_(\w+)\(", (OPERATOR / "kube.py").read_text())
    assert calls, "no Kubernetes client calls found in kube.py"
    return {(*CLIENT_RESOURCES[resource], CLIENT_VERBS[verb]) for verb, resource in calls}


def _argument(node: ast.expr) -> str:
    if isinstance(node, ast.Constant):
        return str(node.value)
    assert isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name), ast.dump(node)
    assert node.value.id == "names", ast.dump(node)
    return str(getattr(names, node.attr))


def _kopf_calls() -> set[tuple[str, str, str]]:
    """What kopf does for the handlers in handlers.py: list and watch each resource a handler
    names, and patch the resources whose handlers keep state."""
    found: set[tuple[str, str, str]] = set()
    for node in ast.walk(ast.parse((OPERATOR / "handlers.py").read_text())):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if not isinstance(decorator, ast.Call) or len(decorator.args) < 3:
                continue  # kopf.on.startup() and the like name no resource
            kind = ast.unparse(decorator.func).rsplit(".", 1)[-1]
            group, _, plural = (_argument(a) for a in decorator.args[:3])
            found |= {(group, plural, "list"), (group, plural, "watch")}
            if kind in STATEFUL_HANDLERS:
                found.add((group, plural, "patch"))
    assert found, "no kopf resource handlers found in handlers.py"
    return found


def test_rules_are_exactly_what_the_operator_calls() -> None:
    assert _client_calls() | _kopf_calls() | {OWNER_REFERENCES} == \
        OPERATOR_PERMISSIONS | LEADER_ELECTION_PERMISSIONS


def _leader_election_role(objects: list[dict]) -> None:
    """The Lease's Role and RoleBinding: in the release's namespace, for the ServiceAccount."""
    role, binding = [next(o for o in find(objects, kind)
                          if o["metadata"]["name"] == "shoal-operator-leader-election")
                     for kind in ("Role", "RoleBinding")]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    assert rule_permissions(role["rules"]) == LEADER_ELECTION_PERMISSIONS
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "shoal-operator",
                                    "namespace": NAMESPACE}]


def test_default_install_is_one_cluster_role_bound_to_the_service_account() -> None:
    objects = render()
    assert sorted(o["kind"] for o in objects) == [
        "ClusterRole", "ClusterRoleBinding", "Deployment", "PodDisruptionBudget", "Role",
        "RoleBinding", "ServiceAccount"]
    _leader_election_role(objects)
    role, binding = only(objects, "ClusterRole"), only(objects, "ClusterRoleBinding")
    account = only(objects, "ServiceAccount")
    assert rule_permissions(role["rules"]) == OPERATOR_PERMISSIONS
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": NAMESPACE}]
    pod = only(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"] == "shoal-operator"
    assert pod["automountServiceAccountToken"] is True


def test_watch_namespaces_gives_a_role_in_each_and_no_cluster_role() -> None:
    objects = render(set_values=["watchNamespaces={team-a,team-b}"])
    assert find(objects, "ClusterRole") == find(objects, "ClusterRoleBinding") == []
    _leader_election_role(objects)
    roles, bindings = [[o for o in find(objects, kind)
                        if not o["metadata"]["name"].endswith("-leader-election")]
                       for kind in ("Role", "RoleBinding")]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for role in roles:
        assert rule_permissions(role["rules"]) == OPERATOR_PERMISSIONS
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "shoal-operator",
                                        "namespace": NAMESPACE}]


@pytest.mark.parametrize("values", [[], *([path] for path in CI_VALUES)],
                         ids=["default", *(path.stem for path in CI_VALUES)])
def test_rbac_never_grants_secrets_or_wildcards(values: list[Path]) -> None:
    objects = render(*values)
    roles = find(objects, "ClusterRole") + find(objects, "Role")
    assert roles
    for role in roles:
        for group, resource, verb in rule_permissions(role["rules"]):
            assert "*" not in (group, resource, verb)
            assert resource not in ("secrets", "configmaps")
        assert all(set(rule) == {"apiGroups", "resources", "verbs"} for rule in role["rules"])
