"""The chart under test: the helm binary `make kube-tools` built, `helm template` as parsed
objects, and the permissions the operator's RBAC must grant (the unit and e2e tests share them)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from tests.support.kube.binaries import REPO, tools_dir

CHART = REPO / "helm" / "shoal"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
HELM_GO_MOD = REPO / "tools" / "helm" / "go.mod"
# image.repository, which the chart requires, for the tests that name no image: the first values
# file, so a later file or --set overrides it
IMAGE_VALUES = Path(__file__).with_name("chart-image-values.yaml")
IMAGE_REPOSITORY = "registry.example.com/ml/shoal"
RELEASE, NAMESPACE = "shoal", "shoal-system"

# (apiGroup, resource, verb) the operator's ServiceAccount holds in each namespace it watches:
# what shoal_operator.kube calls, what kopf calls (watch the resources of its handlers, patch its
# finalizer on a ModelDeployment, post Events), and update on modeldeployments/finalizers, which
# an apiserver with OwnerReferencesPermissionEnforcement asks of whoever creates a child with
# blockOwnerDeletion (the operator's pods and Services).
OPERATOR_PERMISSIONS = frozenset(
    [("shoal.dev", "modeldeployments", verb) for verb in ("get", "list", "watch", "patch")]
    + [("shoal.dev", "modeldeployments/status", "update"),
       ("shoal.dev", "modeldeployments/scale", "patch"),
       ("shoal.dev", "modeldeployments/finalizers", "update")]
    + [("", "pods", verb) for verb in ("list", "watch", "create", "delete")]
    + [("", "services", verb) for verb in ("list", "create", "delete")]
    + [("apps", "deployments", verb) for verb in ("list", "create", "patch", "delete")]
    + [("", "events", "create")]
    + [("networking.k8s.io", "networkpolicies", verb)
       for verb in ("list", "create", "patch", "delete")])

# ... and in the release's namespace, for its leader election's Lease
LEADER_ELECTION_PERMISSIONS = frozenset(
    ("coordination.k8s.io", "leases", verb) for verb in ("get", "create", "update"))


def helm_binary() -> Path:
    """The helm that tools/helm/build.sh built for the version tools/helm/go.mod pins."""
    found = re.search(r"^\s*helm\.sh/helm/v3 (v\S+)", HELM_GO_MOD.read_text(), re.MULTILINE)
    assert found, f"{HELM_GO_MOD} does not require helm.sh/helm/v3"
    binary = tools_dir() / f"helm-{found.group(1)}" / "helm"
    assert binary.exists(), f"{binary} is not built: run `make kube-tools` (tools/helm/build.sh)"
    return binary


def run_helm(*args: str | Path, check: bool = True,
             kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run helm; unless `check` is false, a non-zero exit fails the test with helm's stderr."""
    argv = [str(helm_binary()), *(str(a) for a in args)]
    if kubeconfig is not None:
        argv += ["--kubeconfig", str(kubeconfig)]
    result = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stderr}")
    return result


def values_args(values_files: Iterable[Path] = (), set_values: Iterable[str] = ()) -> list[str]:
    args = ["--values", str(IMAGE_VALUES)]
    for path in values_files:
        args += ["--values", str(path)]
    for assignment in set_values:
        args += ["--set", assignment]
    return args


def render(*values_files: Path, set_values: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The objects `helm template` renders for the release shoal in shoal-system."""
    out = run_helm("template", RELEASE, CHART, "--namespace", NAMESPACE,
                   *values_args(values_files, set_values)).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def find(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = find(objects, kind)
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


def rule_permissions(rules: list[dict[str, Any]]) -> frozenset[tuple[str, str, str]]:
    """Role rules as (apiGroup, resource, verb) triples."""
    return frozenset((group, resource, verb) for rule in rules
                     for group in rule.get("apiGroups", [])
                     for resource in rule.get("resources", [])
                     for verb in rule.get("verbs", []))
