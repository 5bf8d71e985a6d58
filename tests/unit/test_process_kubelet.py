"""The process kubelet's decisions, without a cluster: image config and host paths, a
container's command and environment, DNS records and hosts files, pod phase and status,
restarts, termination messages, scheduling, volume mounts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube.binaries import REPO, kubernetes_version
from tests.support.kube.kubelet import dns
from tests.support.kube.kubelet.container import Backoff, should_restart, termination_message
from tests.support.kube.kubelet.environment import (
    ContainerConfigError,
    PodNetwork,
    container_argv,
    container_env,
    expand,
    service_links,
)
from tests.support.kube.kubelet.image import HostPaths, ImageConfig, parse_dockerfile, shoal_image
from tests.support.kube.kubelet.node import node_labels, unschedulable_reason
from tests.support.kube.kubelet.pod_status import pod_phase, pod_status
from tests.support.kube.kubelet.volumes import volume_binds

PATHS = HostPaths(mapping=(("/opt/venv", "/venv"), ("/opt/shoal/image", "/repo/image"),
                           ("/opt/shoal", "/cache")))
NETWORK = PodNetwork(pod_ip="127.77.0.2", host_ip="127.0.0.1", apiserver_port=6443)


def pod(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1",
                         "labels": {"app": "a"}},
            "spec": {"nodeName": "node", "serviceAccountName": "sa",
                     "containers": [{"name": "c"}], **spec}}


def test_kubernetes_version_comes_from_the_tools_module() -> None:
    assert kubernetes_version("require (\n\tk8s.io/kubernetes v1.36.3 // indirect\n)") == "1.36.3"


def test_the_shoal_image_runs_its_entrypoint_from_this_checkout() -> None:
    image = shoal_image()
    assert image.entrypoint == ("/opt/venv/bin/python", "/opt/shoal/image/entrypoint.py")
    assert image.env["SHOAL_HOST"] == "0.0.0.0"
    argv = container_argv({"args": ["--port", "1"]}, image, HostPaths.of_this_checkout(), {})
    assert argv == [f"{sys.prefix}/bin/python", str(REPO / "image" / "entrypoint.py"),
                    "--port", "1"]


def test_parse_dockerfile_reads_the_final_stage() -> None:
    image = parse_dockerfile(
        "FROM a AS build\nENV X=build\nENTRYPOINT [\"no\"]\n"
        "FROM b\n# comment\nENV PATH=/opt/venv/bin:$PATH \\\n    A=\"one two\"\n"
        "ENV LEGACY value with spaces\nWORKDIR /home/x\nENTRYPOINT [\"/bin/run\", \"-v\"]\n"
        "CMD serve now\n")
    assert image.entrypoint == ("/bin/run", "-v")
    assert image.cmd == ("/bin/sh", "-c", "serve now")
    assert image.workdir == "/home/x"
    assert image.env["PATH"].startswith("/opt/venv/bin:/usr/local/sbin:")
    assert (image.env["A"], image.env["LEGACY"]) == ("one two", "value with spaces")
    assert "X" not in image.env


@pytest.mark.parametrize(("argv", "expected"), [
    (["python", "-c", "x"], [sys.executable, "-c", "x"]),
    (["python3.11", "/opt/shoal/image/healthcheck.py"],
     [sys.executable, "/repo/image/healthcheck.py"]),
    (["/opt/venv/bin/shoal", "serve"], ["/venv/bin/shoal", "serve"]),
    (["/usr/bin/python3", "-V"], [sys.executable, "-V"]),
    (["/somewhere/python", "-V"], ["/somewhere/python", "-V"]),
    (["sh", "-c", "echo /opt/venv"], ["sh", "-c", "echo /opt/venv"]),
])
def test_commands_run_from_the_venv_and_the_checkout(argv: list[str],
                                                      expected: list[str]) -> None:
    assert PATHS.command(argv) == expected


def test_env_paths_map_to_this_machine() -> None:
    assert PATHS.env_value("/opt/venv/bin:/usr/bin") == "/venv/bin:/usr/bin"
    assert PATHS.env_value("/opt/shoal") == "/cache"
    assert PATHS.env_value("0.0.0.0") == "0.0.0.0"


def test_expand_follows_kubernetes_rules() -> None:
    assert expand("$(A)-$$(A)-$(MISSING)-$A", {"A": "1"}) == "1-$(A)-$(MISSING)-$A"


@pytest.mark.parametrize(("container", "expected"), [
    ({"command": ["run"], "args": ["$(X)"]}, ["run", "x"]),
    ({"command": ["run"]}, ["run"]),  # the image's CMD is not used with a command
    ({"args": ["--flag"]}, ["/bin/entry", "--flag"]),
    ({}, ["/bin/entry", "default"]),
])
def test_container_argv(container: dict[str, Any], expected: list[str]) -> None:
    image = ImageConfig(entrypoint=("/bin/entry",), cmd=("default",), env={}, workdir="/")
    assert container_argv(container, image, PATHS, {"X": "x"}) == expected


def test_container_env_layers_image_services_apiserver_and_the_container() -> None:
    image = ImageConfig(entrypoint=(), cmd=(), workdir="/",
                        env={"PATH": "/opt/venv/bin:/bin", "SHOAL_PORT": "30000"})
    shoal = {"metadata": {"name": "shoal", "namespace": "ns"},
             "spec": {"clusterIP": "198.18.0.9", "ports": [{"port": 80, "name": "http"}]}}
    objects = {("ConfigMap", "ns", "cfg"): {"kind": "ConfigMap", "data": {"k": "v"}},
               ("Secret", "ns", "sec"): {"kind": "Secret", "data": {"t": "c2VjcmV0"}}}
    container = {"env": [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "ADDR", "value": "$(POD_IP):1"},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "K", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}}},
        {"name": "T", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "t"}}},
        {"name": "GONE", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "k",
                                                           "optional": True}}}],
        "envFrom": [{"prefix": "CFG_", "configMapRef": {"name": "cfg"}}]}

    def env_of(spec: dict[str, Any]) -> dict[str, str]:
        return container_env(pod(**spec), container, image=image, paths=PATHS, home="/root",
                             network=NETWORK, services=[shoal],
                             lookup=lambda kind, ns, name: objects.get((kind, ns, name)))

    env = env_of({})
    assert env["PATH"] == "/venv/bin:/bin"
    assert (env["POD_IP"], env["ADDR"], env["APP"]) == ("127.77.0.2", "127.77.0.2:1", "a")
    assert (env["K"], env["T"], env["CFG_k"]) == ("v", "secret", "v")
    assert "GONE" not in env
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    assert env["KUBERNETES_SERVICE_PORT"] == "6443"
    # a Service called shoal overrides the image's SHOAL_PORT, as on a real kubelet
    assert env["SHOAL_PORT"] == "tcp://198.18.0.9:80"
    assert env_of({"enableServiceLinks": False})["SHOAL_PORT"] == "30000"


def test_unemulated_env_sources_are_config_errors() -> None:
    with pytest.raises(ContainerConfigError, match="not emulated"):
        container_env(pod(), {"env": [{"name": "X", "valueFrom": {"resourceFieldRef": {
            "resource": "limits.cpu"}}}]}, image=ImageConfig((), (), {}, "/"), paths=PATHS,
            home="/", network=NETWORK, services=[], lookup=lambda *_: None)


def test_service_links_use_docker_link_names() -> None:
    env = service_links([{"metadata": {"name": "my-svc", "namespace": "ns"}, "spec": {
        "clusterIP": "198.18.0.5", "ports": [{"name": "http-api", "port": 80},
                                              {"port": 81, "protocol": "UDP"}]}},
        {"metadata": {"name": "headless", "namespace": "ns"},
         "spec": {"clusterIP": "None", "ports": [{"port": 1}]}}])
    assert env["MY_SVC_SERVICE_HOST"] == "198.18.0.5"
    assert env["MY_SVC_SERVICE_PORT"] == "80"
    assert env["MY_SVC_SERVICE_PORT_HTTP_API"] == "80"
    assert env["MY_SVC_PORT"] == "tcp://198.18.0.5:80"
    assert env["MY_SVC_PORT_81_UDP_ADDR"] == "198.18.0.5"
    assert not any(k.startswith("HEADLESS") for k in env)


def endpoint_slice(service: str, *endpoints: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "labels": {dns.SERVICE_NAME_LABEL: service}},
            "endpoints": list(endpoints)}


def test_service_records_follow_the_endpoint_slices() -> None:
    services = [{"metadata": {"namespace": "ns", "name": name}, "spec": {"clusterIP": "None"}}
                for name in ("group", "empty")]
    slices = [
        endpoint_slice("group", {"addresses": ["127.1.0.2"], "hostname": "leader",
                                 "conditions": {"ready": True}},
                       {"addresses": ["127.1.0.3"], "conditions": {}},
                       {"addresses": ["127.1.0.4"], "conditions": {"ready": False}}),
        endpoint_slice("empty"),
        endpoint_slice("unknown", {"addresses": ["127.1.0.9"]}),
    ]
    assert dns.service_records(services, slices) == {
        "group.ns.svc.cluster.local": ("127.1.0.2", "127.1.0.3"),
        "leader.group.ns.svc.cluster.local": ("127.1.0.2",)}


def test_hosts_file_has_the_pod_and_the_names_its_search_path_reaches() -> None:
    records = {"leader.group.ns.svc.cluster.local": ("127.1.0.2",),
               "web.other.svc.cluster.local": ("127.1.0.5", "127.1.0.6")}
    hosts = dns.hosts_file(pod(hostname="w", subdomain="group",
                               hostAliases=[{"ip": "127.9.9.9", "hostnames": ["alias"]}]),
                           "127.1.0.3", records)
    lines = hosts.splitlines()
    assert "127.1.0.3\tw.group.ns.svc.cluster.local\tw" in lines
    assert "127.9.9.9\talias" in lines
    assert ("127.1.0.2\tleader.group.ns.svc.cluster.local leader.group leader.group.ns "
            "leader.group.ns.svc") in lines
    assert "127.1.0.6\tweb.other.svc.cluster.local web.other web.other.svc" in lines
    assert "127.0.0.1\tlocalhost" in lines


def running(**extra: Any) -> dict[str, Any]:
    return {"state": {"running": {}}, "ready": True, **extra}


def ended(code: int) -> dict[str, Any]:
    return {"state": {"terminated": {"exitCode": code}}, "ready": False}


BACKING_OFF = {"state": {"waiting": {"reason": "CrashLoopBackOff"}}, "ready": False,
               "lastState": {"terminated": {"exitCode": 1}}}
CREATING = {"state": {"waiting": {"reason": "ContainerCreating"}}, "ready": False}


@pytest.mark.parametrize(("policy", "containers", "phase"), [
    ("Always", [running()], "Running"),
    ("Always", [CREATING], "Pending"),
    ("Always", [running(), CREATING], "Pending"),
    ("Always", [BACKING_OFF], "Running"),
    ("Always", [ended(0)], "Running"),
    ("OnFailure", [ended(0)], "Succeeded"),
    ("OnFailure", [ended(0), ended(1)], "Running"),
    ("Never", [ended(0)], "Succeeded"),
    ("Never", [ended(0), ended(3)], "Failed"),
    ("Never", [ended(3), running()], "Running"),
])
def test_pod_phase(policy: str, containers: list[dict[str, Any]], phase: str) -> None:
    assert pod_phase(policy, True, False, containers) == phase


def test_pod_phase_before_and_after_init_containers() -> None:
    assert pod_phase("Never", False, False, [running()]) == "Pending"
    assert pod_phase("Never", False, True, [CREATING]) == "Failed"


def test_pod_status_keeps_transition_times_of_unchanged_conditions() -> None:
    def status(ready: bool, previous: list[dict[str, Any]], now: str) -> dict[str, Any]:
        return pod_status(restart_policy="Always", pod_ip="127.1.0.2", host_ip="127.0.0.1",
                          start_time="t0", init_statuses=[], initialized=True,
                          init_failed=False, previous_conditions=previous, now=now,
                          container_statuses=[running(ready=ready)])

    first = status(False, [], "t1")
    second = status(True, first["conditions"], "t2")
    by_type = {c["type"]: c for c in second["conditions"]}
    assert (by_type["Ready"]["status"], by_type["Ready"]["lastTransitionTime"]) == ("True", "t2")
    assert by_type["PodScheduled"]["lastTransitionTime"] == "t1"
    assert second["podIPs"] == [{"ip": "127.1.0.2"}]
    assert second["phase"] == "Running"


@pytest.mark.parametrize(("policy", "code", "is_init", "restart"), [
    ("Always", 0, False, True), ("Always", 1, False, True),
    ("OnFailure", 0, False, False), ("OnFailure", 2, False, True),
    ("Never", 1, False, False),
    ("Always", 0, True, False), ("Always", 1, True, True), ("Never", 1, True, False),
])
def test_should_restart(policy: str, code: int, is_init: bool, restart: bool) -> None:
    assert should_restart(policy, code, is_init) is restart


def test_backoff_doubles_up_to_its_maximum_and_resets_after_a_long_run() -> None:
    backoff = Backoff(initial_s=1, max_s=4, reset_s=60)
    delays = [0.0]
    for _ in range(4):
        delays.append(backoff.delay(delays[-1], run_s=1))
    assert delays[1:] == [1, 2, 4, 4]
    assert backoff.delay(4, run_s=61) == 1


def test_termination_message_reads_the_file_or_falls_back_to_the_log(tmp_path: Path) -> None:
    message, log = tmp_path / "termination-log", tmp_path / "run-0.log"
    message.write_text("x" * 5000)
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert termination_message(message, log, "File", 1) == "x" * 4096
    message.write_text("")
    assert termination_message(message, log, "File", 1) == ""
    assert termination_message(message, log, "FallbackToLogsOnError", 0) == ""
    fallback = termination_message(message, log, "FallbackToLogsOnError", 1)
    assert fallback.startswith("line 20\n") and fallback.endswith("line 99")


def test_node_selector_decides_whether_the_node_fits() -> None:
    labels = node_labels("n")
    assert unschedulable_reason(pod(nodeSelector={"kubernetes.io/os": "linux"}), labels) is None
    assert "node selector" in (unschedulable_reason(pod(nodeSelector={"gpu": "yes"}), labels)
                               or "")


def test_volume_binds_mount_parents_first(tmp_path: Path) -> None:
    volumes = {"data": tmp_path / "data", "model": tmp_path / "model"}
    binds = volume_binds({"volumeMounts": [
        {"name": "model", "mountPath": "/data/model", "subPath": "m1", "readOnly": True},
        {"name": "data", "mountPath": "/data"}]}, volumes)
    assert binds == [
        {"source": str(tmp_path / "data"), "target": "/data", "read_only": False},
        {"source": str(tmp_path / "model" / "m1"), "target": "/data/model", "read_only": True}]
    assert (tmp_path / "model" / "m1").is_dir()
    with pytest.raises(ContainerConfigError):
        volume_binds({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, volumes)
