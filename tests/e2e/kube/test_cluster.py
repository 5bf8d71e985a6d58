"""The test cluster really works: a real API server (CRUD, watch, CRDs, RBAC), the real
controller-manager (garbage collection, EndpointSlices, Deployments) and the process kubelet
(pods as processes: addresses, DNS, status, termination, restarts, ServiceAccount tokens)."""

from __future__ import annotations

import json
import textwrap
import threading
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import psutil
import pytest
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ConflictError, ForbiddenError, NotFoundError

from tests.support.kube.cluster import KubeCluster
from tests.support.kube.kubelet_handle import KubeletHandle
from tests.support.wait import wait_until

POD_TIMEOUT_S = 60.0


@pytest.fixture
def kube(kube_cluster: KubeCluster) -> DynamicClient:
    return kube_cluster.dynamic_client()


def resource(kube: DynamicClient, kind: str, api_version: str = "v1") -> Any:
    return kube.resources.get(api_version=api_version, kind=kind)


def python_pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
    """A pod whose one container runs `script` with python (the venv's, in the process kubelet);
    `spec` entries are added to the pod's spec, `container` ones to the container."""
    container = {"name": "main", "image": "shoal:test",
                 "command": ["python", "-c", textwrap.dedent(script)],
                 **spec.pop("container", {})}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": spec.pop("labels", {"app": name})},
            "spec": {"containers": [container], "terminationGracePeriodSeconds": 2, **spec}}


def create(kube: DynamicClient, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
    api = resource(kube, manifest["kind"], manifest.get("apiVersion", "v1"))
    return kube.create(api, body=manifest, namespace=namespace).to_dict()


def get_pod(kube: DynamicClient, namespace: str, name: str) -> dict[str, Any]:
    return resource(kube, "Pod").get(name=name, namespace=namespace).to_dict()


def wait_pod(kube: DynamicClient, namespace: str, name: str, what: str,
             predicate: Any, timeout: float = POD_TIMEOUT_S) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        pod = get_pod(kube, namespace, name)
        return pod if predicate(pod) else None
    return wait_until(check, timeout, what=f"pod {name} not {what}")


def is_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod.get("status", {}).get("conditions") or [])


def terminated(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["status"]["containerStatuses"][0]["state"].get("terminated") or {}


def wait_finished(kube: DynamicClient, namespace: str, name: str) -> dict[str, Any]:
    return wait_pod(kube, namespace, name, "finished",
                    lambda p: p.get("status", {}).get("phase") in ("Succeeded", "Failed"))


def watch_until_deleted(kube: DynamicClient, namespace: str, name: str,
                        started: threading.Event, seen: list[dict[str, Any]]) -> None:
    """Collect every version of the pod until it is deleted (run on a thread)."""
    watcher = kubernetes.watch.Watch()
    pods = resource(kube, "Pod")
    for event in pods.watch(namespace=namespace, name=name, watcher=watcher,
                            timeout=int(POD_TIMEOUT_S)):
        started.set()
        seen.append(event["raw_object"])
        if event["type"] == "DELETED":
            watcher.stop()


# the API server -------------------------------------------------------------------------------
def test_crud_watch_and_conflicts(kube: DynamicClient, namespace: str) -> None:
    maps = resource(kube, "ConfigMap")
    events: list[tuple[str, str]] = []
    started = threading.Event()

    def watch() -> None:
        watcher = kubernetes.watch.Watch()
        for event in maps.watch(namespace=namespace, name="config", watcher=watcher, timeout=30):
            started.set()
            events.append((event["type"], (event["raw_object"].get("data") or {}).get("k", "")))
            if event["type"] == "DELETED":
                watcher.stop()

    created = create(kube, namespace, {"kind": "ConfigMap", "metadata": {"name": "config"},
                                       "data": {"k": "one"}})
    watching = threading.Thread(target=watch)
    watching.start()
    assert started.wait(10)
    stale = created["metadata"]["resourceVersion"]
    maps.replace(namespace=namespace, body={**created, "data": {"k": "two"}})
    with pytest.raises(ConflictError):
        maps.replace(namespace=namespace, body={**created, "data": {"k": "three"},
                                                "metadata": {**created["metadata"],
                                                             "resourceVersion": stale}})
    assert maps.get(namespace=namespace, name="config").data.k == "two"
    maps.delete(namespace=namespace, name="config")
    watching.join(30)
    assert events == [("ADDED", "one"), ("MODIFIED", "two"), ("DELETED", "two")]
    with pytest.raises(NotFoundError):
        maps.get(namespace=namespace, name="config")


def test_custom_resource_with_status_subresource(kube_cluster: KubeCluster, kube: DynamicClient,
                                                 namespace: str, tmp_path: Path) -> None:
    crd = tmp_path / "crd.yaml"
    crd.write_text(textwrap.dedent("""\
        apiVersion: apiextensions.k8s.io/v1
        kind: CustomResourceDefinition
        metadata: {name: widgets.test.shoal.dev}
        spec:
          group: test.shoal.dev
          scope: Namespaced
          names: {plural: widgets, singular: widget, kind: Widget}
          versions:
          - name: v1
            served: true
            storage: true
            subresources: {status: {}}
            schema:
              openAPIV3Schema:
                type: object
                properties:
                  spec: {type: object, properties: {size: {type: integer, minimum: 1}}}
                  status: {type: object, properties: {phase: {type: string}}}
        """))
    kube_cluster.apply_file(crd)
    crd.write_text(crd.read_text().replace("kind: Widget}", "kind: Widget, shortNames: [wd]}"))
    [applied] = kube_cluster.apply_file(crd)  # applying again updates it
    assert applied["spec"]["names"]["shortNames"] == ["wd"]
    widgets = resource(kube, "Widget", "test.shoal.dev/v1")
    create(kube, namespace, {"apiVersion": "test.shoal.dev/v1", "kind": "Widget",
                             "metadata": {"name": "w"}, "spec": {"size": 2}})
    widgets.status.patch(namespace=namespace, name="w", body={"status": {"phase": "Ready"}},
                         content_type="application/merge-patch+json")
    # the main resource ignores status, the status subresource ignores spec
    widgets.patch(namespace=namespace, name="w", content_type="application/merge-patch+json",
                  body={"spec": {"size": 3}, "status": {"phase": "Ignored"}})
    widgets.status.patch(namespace=namespace, name="w",
                         content_type="application/merge-patch+json",
                         body={"spec": {"size": 9}})
    widget = widgets.get(namespace=namespace, name="w").to_dict()
    assert (widget["spec"], widget["status"]) == ({"size": 3}, {"phase": "Ready"})
    with pytest.raises(kubernetes.dynamic.exceptions.UnprocessibleEntityError):
        create(kube, namespace, {"apiVersion": "test.shoal.dev/v1", "kind": "Widget",
                                 "metadata": {"name": "bad"}, "spec": {"size": 0}})


def test_rbac_refuses_a_token_user_without_rights(kube_cluster: KubeCluster,
                                                  kube: DynamicClient, namespace: str,
                                                  tmp_path: Path) -> None:
    create(kube, namespace, {"kind": "ServiceAccount", "metadata": {"name": "reader"}})
    token = resource(kube, "ServiceAccount").token.create(
        namespace=namespace, name="reader",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
              "spec": {"expirationSeconds": 600}}).status.token
    as_reader = DynamicClient(kubernetes.config.new_client_from_config(str(
        kube_cluster.kubeconfig_for_token(token, tmp_path / "reader.kubeconfig"))))
    with pytest.raises(ForbiddenError):
        resource(as_reader, "Pod").get(namespace=namespace)
    create(kube, namespace, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]})
    create(kube, namespace, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "reader-reads-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}]})
    wait_until(lambda: _can_list_pods(as_reader, namespace), 10,
               what="the RoleBinding never took effect")
    with pytest.raises(ForbiddenError):
        resource(as_reader, "Secret").get(namespace=namespace)


def _can_list_pods(client: DynamicClient, namespace: str) -> bool:
    try:
        resource(client, "Pod").get(namespace=namespace)
    except ForbiddenError:
        return False
    return True


# the controller-manager -----------------------------------------------------------------------
@pytest.mark.parametrize("propagation", ["Background", "Foreground"])
def test_cascading_deletion_through_the_garbage_collector(kube: DynamicClient, namespace: str,
                                                          propagation: str) -> None:
    owner = create(kube, namespace, {"kind": "ConfigMap", "metadata": {"name": "owner"}})
    reference = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                 "uid": owner["metadata"]["uid"], "blockOwnerDeletion": True}
    for i in range(3):
        create(kube, namespace, {"kind": "Secret", "metadata": {
            "name": f"dependent-{i}", "ownerReferences": [reference]}})
    resource(kube, "ConfigMap").delete(namespace=namespace, name="owner",
                                       body={"propagationPolicy": propagation})
    secrets = resource(kube, "Secret")
    wait_until(lambda: not [s for s in secrets.get(namespace=namespace).items
                            if s.metadata.name.startswith("dependent-")], 30,
               what="dependents not collected")
    wait_until(lambda: not [m for m in resource(kube, "ConfigMap").get(namespace=namespace).items
                            if m.metadata.name == "owner"], 30, what="owner still there")


# the process kubelet --------------------------------------------------------------------------
HTTP_SERVER = """\
    import http.server, os
    http.server.HTTPServer((os.environ["POD_IP"], 8080),
                           http.server.SimpleHTTPRequestHandler).serve_forever()
"""
POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def test_pod_gets_ready_on_its_own_address_and_into_an_endpoint_slice(
        kube: DynamicClient, namespace: str) -> None:
    create(kube, namespace, {"kind": "Service", "metadata": {"name": "web"}, "spec": {
        "selector": {"app": "web"}, "ports": [{"port": 8080, "targetPort": "http"}]}})
    create(kube, namespace, python_pod("web", HTTP_SERVER, container={
        "env": [POD_IP_ENV], "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"port": "http", "path": "/"}, "periodSeconds": 1}}))
    pod = wait_pod(kube, namespace, "web", "Ready", is_ready)
    ip = pod["status"]["podIP"]
    assert ip.startswith("127.") and ip != "127.0.0.1"
    assert pod["status"]["phase"] == "Running"
    assert pod["spec"]["nodeName"] == "shoal-test-node"
    status = pod["status"]["containerStatuses"][0]
    assert (status["ready"], status["started"], status["restartCount"]) == (True, True, 0)
    assert "running" in status["state"]
    assert httpx.get(f"http://{ip}:8080/").status_code == 200
    slices = resource(kube, "EndpointSlice", "discovery.k8s.io/v1")

    def addresses() -> list[str]:
        return [a for s in slices.get(namespace=namespace,
                                      label_selector="kubernetes.io/service-name=web").items
                for e in s.endpoints or [] if e.conditions.ready for a in e.addresses]

    assert wait_until(addresses, 30, what="no ready endpoint") == [ip]


def test_pods_resolve_their_hostname_and_a_siblings_dns_name(
        kube: DynamicClient, namespace: str) -> None:
    create(kube, namespace, {"kind": "Service", "metadata": {"name": "group"}, "spec": {
        "clusterIP": "None", "publishNotReadyAddresses": True,
        "selector": {"group": "g"}, "ports": [{"port": 8080}]}})
    create(kube, namespace, python_pod("leader", "import time; time.sleep(600)",
                                       hostname="leader", subdomain="group",
                                       labels={"group": "g"}))
    fqdn = f"leader.group.{namespace}.svc.cluster.local"
    create(kube, namespace, python_pod("worker", f"""\
        import json, socket, time
        names = ["{fqdn}", "leader.group", "group"]
        own = "worker.group.{namespace}.svc.cluster.local"
        while True:  # until the leader and this pod are both behind the headless Service
            try:
                found = {{n: sorted({{a[4][0] for a in socket.getaddrinfo(n, 80, socket.AF_INET)}})
                         for n in names}}
                if len(found["group"]) == 2:
                    break
            except socket.gaierror:
                pass
            time.sleep(0.2)
        with open("/dev/termination-log", "w") as f:
            json.dump({{"hostname": socket.gethostname(), "found": found,
                        "own": socket.gethostbyname(own)}}, f)
        """, hostname="worker", subdomain="group", labels={"group": "g"},
                                       restartPolicy="Never"))
    worker = wait_finished(kube, namespace, "worker")
    leader_ip = get_pod(kube, namespace, "leader")["status"]["podIP"]
    worker_ip = worker["status"]["podIP"]
    result = json.loads(terminated(worker)["message"])
    assert result == {"hostname": "worker", "own": worker_ip, "found": {
        fqdn: [leader_ip], "leader.group": [leader_ip],
        "group": sorted([leader_ip, worker_ip])}}


def test_a_read_only_root_with_an_empty_dir_at_tmp(kube: DynamicClient, namespace: str,
                                                  kubelet: KubeletHandle) -> None:
    """readOnlyRootFilesystem: writes outside the volumes fail; an emptyDir mounted over /tmp
    is private to the pod and hides none of the pod's other mounts, whose sources live under
    the host's /tmp here."""
    create(kube, namespace, {"kind": "ConfigMap", "metadata": {"name": "conf"},
                             "data": {"greeting": "hello"}})
    create(kube, namespace, python_pod("locked", """\
        import errno, os
        try:
            open("/root-file", "w")
        except OSError as e:
            assert e.errno == errno.EROFS, e
        else:
            raise SystemExit("the root filesystem is writable")
        open("/tmp/scratch", "w").write("mine")
        assert os.listdir("/tmp") == ["scratch"], os.listdir("/tmp")
        assert open("/conf/greeting").read() == "hello"
        open("/dev/termination-log", "w").write("ok")
        """, restartPolicy="Never",
        volumes=[{"name": "tmp", "emptyDir": {}},
                 {"name": "conf", "configMap": {"name": "conf"}}],
        container={"securityContext": {"readOnlyRootFilesystem": True},
                   "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                                    {"name": "conf", "mountPath": "/conf"}]}))
    locked = wait_finished(kube, namespace, "locked")
    assert (terminated(locked)["exitCode"], terminated(locked).get("message")) == (0, "ok"), \
        kubelet.pod_log(namespace, "locked")
    assert not Path("/tmp/scratch").exists() and not Path("/root-file").exists()


def test_exit_code_and_termination_message_land_in_the_container_status(
        kube: DynamicClient, namespace: str) -> None:
    create(kube, namespace, python_pod("fails", """\
        open("/dev/termination-log", "w").write("disk on fire")
        raise SystemExit(3)
        """, restartPolicy="Never"))
    create(kube, namespace, python_pod("falls-back", """\
        for i in range(100):
            print("line", i)
        raise SystemExit(4)
        """, restartPolicy="Never", container={"terminationMessagePolicy":
                                                 "FallbackToLogsOnError"}))
    create(kube, namespace, python_pod("succeeds", "print('done')", restartPolicy="Never"))
    # the image's entrypoint (no command): a bad flag ends in 88 with the JSON message
    create(kube, namespace, {"kind": "Pod", "metadata": {"name": "entrypoint"}, "spec": {
        "restartPolicy": "Never",
        "containers": [{"name": "shoal", "image": "shoal:test", "args": ["--bogus"]}]}})
    fails, falls_back = wait_finished(kube, namespace, "fails"), wait_finished(
        kube, namespace, "falls-back")
    succeeds, entrypoint = wait_finished(kube, namespace, "succeeds"), wait_finished(
        kube, namespace, "entrypoint")
    assert fails["status"]["phase"] == "Failed"
    assert {k: terminated(fails)[k] for k in ("exitCode", "reason", "message")} == {
        "exitCode": 3, "reason": "Error", "message": "disk on fire"}
    assert terminated(falls_back)["exitCode"] == 4
    assert terminated(falls_back)["message"].endswith("line 98\nline 99")
    assert "line 19\n" not in terminated(falls_back)["message"]  # the last 80 lines
    assert succeeds["status"]["phase"] == "Succeeded"
    assert (terminated(succeeds)["exitCode"], terminated(succeeds)["reason"]) == (0, "Completed")
    assert "message" not in terminated(succeeds)
    assert terminated(entrypoint)["exitCode"] == 88
    assert json.loads(terminated(entrypoint)["message"])["reason"] == "startup-failed"
    assert not Path("/dev/termination-log").exists()  # each pod's own, never the host's


def test_a_cpu_limit_is_a_cgroup_quota_the_engine_counts(kube: DynamicClient,
                                                        namespace: str) -> None:
    """`resources.limits.cpu` becomes the CFS quota of the container's own cgroup, which
    `shoal.cpu_cores` reads (the engine sizes its threads by it); the cgroup goes with the run."""
    report = """\
        import json, os
        from shoal.cpu_cores import PROC_CGROUP, PROC_MOUNTINFO, cpu_cgroups, cpu_quota_cores
        from shoal.cpu_cores import usable_cores
        cgroups = cpu_cgroups(PROC_CGROUP.read_text(), PROC_MOUNTINFO.read_text())
        open("/dev/termination-log", "w").write(json.dumps({
            "quota": cpu_quota_cores(cgroups), "usable": usable_cores(),
            "cores": len(os.sched_getaffinity(0)), "cgroups": [str(c.directory) for c in cgroups]}))
        """
    create(kube, namespace, python_pod("limited", report, restartPolicy="Never", container={
        "resources": {"limits": {"cpu": "1500m"}}}))
    create(kube, namespace, python_pod("unlimited", report, restartPolicy="Never"))
    limited = json.loads(terminated(wait_finished(kube, namespace, "limited"))["message"])
    unlimited = json.loads(terminated(wait_finished(kube, namespace, "unlimited"))["message"])
    assert limited["quota"] == 1.5 and limited["usable"] == 1
    assert unlimited["usable"] == unlimited["cores"]  # the host's quota, none here
    assert unlimited["quota"] is None or unlimited["quota"] >= unlimited["cores"]
    own = [d for d in limited["cgroups"] if d not in unlimited["cgroups"]]
    assert own and all(not Path(d).exists() for d in own)  # removed when the run ended


@pytest.mark.parametrize(("handles_sigterm", "exit_code"), [(True, 0), (False, 137)])
def test_deletion_terminates_every_process_of_the_pod(
        kube: DynamicClient, kubelet: KubeletHandle, namespace: str, handles_sigterm: bool,
        exit_code: int) -> None:
    """SIGTERM first (a PID 1 without a handler ignores it, as in a container), SIGKILL after
    the grace period; then the kubelet deletes the pod object."""
    handler = "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))" if handles_sigterm else ""
    create(kube, namespace, python_pod("victim", f"""\
        import signal, subprocess, sys, time
        {handler}
        subprocess.Popen(["sleep", "600"])
        subprocess.Popen(["sh", "-c", "sleep 600"], start_new_session=True)
        print("started", flush=True)
        time.sleep(600)
        """, terminationGracePeriodSeconds=3))
    wait_pod(kube, namespace, "victim", "Running", lambda p: "running" in (
        p["status"].get("containerStatuses") or [{}])[0].get("state", {}))
    processes = wait_until(lambda: len(kubelet.pod_processes(namespace, "victim")) >= 4 and
                           kubelet.pod_processes(namespace, "victim"), 30,
                           what="the pod's processes did not start")
    seen: list[dict[str, Any]] = []
    started = threading.Event()
    watching = threading.Thread(target=watch_until_deleted,
                                args=(kube, namespace, "victim", started, seen))
    watching.start()
    assert started.wait(10)
    resource(kube, "Pod").delete(namespace=namespace, name="victim")
    watching.join(POD_TIMEOUT_S)
    assert seen[-1]["metadata"]["deletionTimestamp"]
    final = [p for p in seen if terminated(p)]
    assert final and terminated(final[-1])["exitCode"] == exit_code
    _, alive = psutil.wait_procs(processes, timeout=5)
    assert not alive
    assert kubelet.pod_processes(namespace, "victim") == []
    assert "started" in kubelet.pod_log(namespace, "victim")


def test_exec_readiness_gates_ready_and_a_failing_liveness_probe_restarts(
        kube: DynamicClient, kubelet: KubeletHandle, namespace: str) -> None:
    """Started once the startup probe passes, Ready only once the exec probe passes; restarted
    once the tcpSocket liveness probe fails (the listener closes after 3 s); the emptyDir
    outlives the restart."""
    create(kube, namespace, python_pod("probed", """\
        import os, pathlib, socket, time
        runs = pathlib.Path("/scratch/runs")
        runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
        print("runs", runs.read_text(), flush=True)
        listener = socket.create_server((os.environ["POD_IP"], 9000))
        time.sleep(1)
        pathlib.Path("/scratch/ready").touch()
        time.sleep(2)
        listener.close()
        time.sleep(600)
        """, volumes=[{"name": "scratch", "emptyDir": {}}], container={
        "env": [POD_IP_ENV], "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
        "startupProbe": {"tcpSocket": {"port": 9000}, "periodSeconds": 1},
        "readinessProbe": {"exec": {"command": ["cat", "/scratch/ready"]}, "periodSeconds": 1},
        "livenessProbe": {"tcpSocket": {"port": 9000}, "periodSeconds": 1,
                          "failureThreshold": 2}}))
    pod = wait_pod(kube, namespace, "probed", "Ready", is_ready)
    status = pod["status"]["containerStatuses"][0]
    assert (status["started"], status["restartCount"]) == (True, 0)
    pod = wait_pod(kube, namespace, "probed", "restarted", lambda p: p["status"][
        "containerStatuses"][0]["restartCount"] >= 1)
    assert pod["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 137
    wait_until(lambda: "runs xx\n" in kubelet.pod_log(namespace, "probed"), 30,
               what="the second run did not see the first one's emptyDir")
    events = resource(kube, "Event").get(namespace=namespace).to_dict()["items"]
    assert any(e["reason"] == "Unhealthy" and "Liveness" in e["message"] for e in events)


def test_a_deployments_pod_is_restarted_after_its_process_exits(
        kube: DynamicClient, kubelet: KubeletHandle, namespace: str) -> None:
    template = python_pod("worker", "import os; print('run', os.getpid(), flush=True)",
                          restartPolicy="Always", labels={"app": "worker"})
    create(kube, namespace, {"apiVersion": "apps/v1", "kind": "Deployment",
                             "metadata": {"name": "worker"}, "spec": {
                                 "replicas": 1, "selector": {"matchLabels": {"app": "worker"}},
                                 "template": {"metadata": template["metadata"],
                                              "spec": template["spec"]}}})
    pods = resource(kube, "Pod")

    def restarted_pod() -> dict[str, Any] | None:
        items = pods.get(namespace=namespace, label_selector="app=worker").to_dict()["items"]
        statuses = [s for p in items for s in p.get("status", {}).get("containerStatuses") or []]
        return items[0] if statuses and statuses[0]["restartCount"] >= 2 else None

    pod = wait_until(restarted_pod, POD_TIMEOUT_S, what="the pod was never restarted")
    status = pod["status"]["containerStatuses"][0]
    assert status["lastState"]["terminated"]["exitCode"] == 0
    assert pod["status"]["phase"] == "Running"
    assert kubelet.pod_log(namespace, pod["metadata"]["name"]).count("run ") >= 2


def test_in_cluster_client_authenticates_with_its_service_account_token(
        kube: DynamicClient, namespace: str) -> None:
    create(kube, namespace, {"kind": "ServiceAccount", "metadata": {"name": "lister"}})
    create(kube, namespace, {"kind": "ConfigMap", "metadata": {"name": "settings"},
                             "data": {"mode": "fast"}})
    create(kube, namespace, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "pod-lister"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]})
    create(kube, namespace, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "lister"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "pod-lister"},
        "subjects": [{"kind": "ServiceAccount", "name": "lister", "namespace": namespace}]})
    create(kube, namespace, python_pod("client", """\
        import json, os
        from kubernetes import client, config
        config.load_incluster_config()
        core = client.CoreV1Api()
        namespace = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
        names = [p.metadata.name for p in core.list_namespaced_pod(namespace).items]
        try:
            core.list_namespace()
            refused = None
        except client.ApiException as e:
            refused = e.status
        with open("/dev/termination-log", "w") as f:
            json.dump({"pods": names, "refused": refused, "namespace": namespace,
                       "mode": open("/etc/settings/mode").read(),
                       "env": {k: os.environ[k] for k in ("MY_NAME", "MY_NAMESPACE", "MY_NODE",
                                                          "MY_ACCOUNT", "MY_UID")}}, f)
        """, serviceAccountName="lister", restartPolicy="Never",
        volumes=[{"name": "settings", "configMap": {"name": "settings"}}], container={
        "volumeMounts": [{"name": "settings", "mountPath": "/etc/settings", "readOnly": True}],
        "env": [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} for name, path in (
            ("MY_NAME", "metadata.name"), ("MY_NAMESPACE", "metadata.namespace"),
            ("MY_NODE", "spec.nodeName"), ("MY_ACCOUNT", "spec.serviceAccountName"),
            ("MY_UID", "metadata.uid"))]}))
    pod = wait_finished(kube, namespace, "client")
    assert pod["status"]["phase"] == "Succeeded", terminated(pod)
    assert json.loads(terminated(pod)["message"]) == {
        "pods": ["client"], "refused": 403, "namespace": namespace, "mode": "fast",
        "env": {"MY_NAME": "client", "MY_NAMESPACE": namespace, "MY_NODE": "shoal-test-node",
                "MY_ACCOUNT": "lister", "MY_UID": pod["metadata"]["uid"]}}
