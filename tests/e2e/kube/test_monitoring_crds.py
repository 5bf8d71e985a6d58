"""The chart's PodMonitor and ServiceMonitor against the real kube-apiserver with
prometheus-operator's own CRDs (from its Go module, tools/prometheus-operator/crds.sh): both
are accepted, and read back whole (a field the CRD does not know would be pruned, or refused)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import kubernetes

from tests.support.helm import CHART, render
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

    custom = kubernetes.client.CustomObjectsApi(kube_cluster.api_client())
    objects = render(CHART / "ci" / "monitoring-values.yaml")
    monitors = [o for o in objects if o["kind"] in MONITORS]
    assert sorted(o["kind"] for o in monitors) == sorted(MONITORS)
    for monitor in monitors:
        monitor["metadata"]["namespace"] = namespace
        plural = MONITORS[monitor["kind"]]
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, monitor)
        stored = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural,
                                                     monitor["metadata"]["name"])
        assert stored["spec"] == monitor["spec"], monitor["kind"]
