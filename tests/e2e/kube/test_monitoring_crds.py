"""The chart installed by `helm install` with its monitors and dashboard on, into the real
kube-apiserver with prometheus-operator's own CRDs (from its Go module,
tools/prometheus-operator/crds.sh): the PodMonitor and ServiceMonitor are accepted and read back
whole (a field the CRD does not know would be pruned, or refused), and the dashboard's ConfigMap
carries Grafana's sidecar label."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import kubernetes
import yaml

from tests.support.helm import CHART, RELEASE, run_helm, values_args
from tests.support.kube.binaries import REPO
from tests.support.kube.cluster import KubeCluster
from tests.support.wait import wait_until

MONITORS = {"PodMonitor": "podmonitors", "ServiceMonitor": "servicemonitors"}
GROUP, VERSION = "monitoring.coreos.com", "v1"


def _crd_folder() -> Path:
    out = subprocess.run([str(REPO / "tools" / "prometheus-operator" / "crds.sh")], check=True,
                         capture_output=True, text=True, timeout=600).stdout
    return Path(out.strip())


def test_the_charts_monitors_are_accepted_by_the_real_apiserver(kube_cluster: KubeCluster,
                                                                namespace: str) -> None:
    folder = _crd_folder()
    ext = kubernetes.client.ApiextensionsV1Api(kube_cluster.api_client())
    for plural in MONITORS.values():
        kube_cluster.apply_file(folder / f"{GROUP}_{plural}.yaml")
        wait_until(lambda plural=plural: any(
            c.type == "Established" and c.status == "True" for c in
            ext.read_custom_resource_definition(f"{plural}.{GROUP}").status.conditions or []),
            30, what=f"CRD {plural} not established")

    # one operator replica watching this namespace alone: it acts on nothing of other tests
    values = values_args([CHART / "ci" / "monitoring-values.yaml"],
                         [f"watchNamespaces={{{namespace}}}", "operator.replicas=1"])
    run_helm("install", RELEASE, CHART, "--namespace", namespace, *values,
             kubeconfig=kube_cluster.admin_kubeconfig)
    try:
        manifest = run_helm("get", "manifest", RELEASE, "--namespace", namespace,
                            kubeconfig=kube_cluster.admin_kubeconfig).stdout
        installed = [doc for doc in yaml.safe_load_all(manifest) if doc]
        monitors = [o for o in installed if o["kind"] in MONITORS]
        assert sorted(o["kind"] for o in monitors) == sorted(MONITORS)
        custom = kubernetes.client.CustomObjectsApi(kube_cluster.api_client())
        for monitor in monitors:
            stored = custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, MONITORS[monitor["kind"]], monitor["metadata"]["name"])
            assert stored["spec"] == monitor["spec"], monitor["kind"]
        (dashboard,) = [o for o in installed if o["kind"] == "ConfigMap"]
        core = kubernetes.client.CoreV1Api(kube_cluster.api_client())
        stored_map = core.read_namespaced_config_map(dashboard["metadata"]["name"], namespace)
        assert stored_map.metadata.labels["grafana_dashboard"] == "1"
        assert json.loads(stored_map.data["shoal.json"])["panels"]
    finally:
        run_helm("uninstall", RELEASE, "--namespace", namespace, "--wait",
                 kubeconfig=kube_cluster.admin_kubeconfig)
