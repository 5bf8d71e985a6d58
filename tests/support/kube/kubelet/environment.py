"""A container's environment and command line, as a kubelet computes them.

Order (later wins): the image's ENV, HOSTNAME and HOME, the Service links of the pod's namespace
(`<NAME>_SERVICE_HOST`, `<NAME>_PORT`, ... unless `enableServiceLinks: false`), the API server
(`KUBERNETES_SERVICE_HOST/PORT`: 127.0.0.1 and its real port here), `envFrom`, then `env` with
`$(VAR)` references and `valueFrom` (downward-API `fieldRef`, `configMapKeyRef`, `secretKeyRef`)
resolved. `$(VAR)` in `command` and `args` is expanded from the result.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.support.kube.kubelet.image import HostPaths, ImageConfig

# (kind, namespace, name) -> the object, or None
Lookup = Callable[[str, str, str], dict[str, Any] | None]
_REFERENCE = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


class ContainerConfigError(RuntimeError):
    """What keeps a container from being created (reason CreateContainerConfigError)."""


@dataclass(frozen=True)
class PodNetwork:
    pod_ip: str
    host_ip: str
    apiserver_port: int


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: $$ is a literal $, unknown references stay as written."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REFERENCE.sub(one, value)


def field_ref(pod: dict[str, Any], path: str, network: PodNetwork) -> str:
    meta = pod["metadata"]
    if (m := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)):
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    values = {
        "metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"], "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        "status.podIP": network.pod_ip, "status.podIPs": network.pod_ip,
        "status.hostIP": network.host_ip, "status.hostIPs": network.host_ip,
    }
    if path not in values:
        raise ContainerConfigError(f"fieldRef {path} is not emulated by the process kubelet")
    return values[path]


def service_links(services: list[dict[str, Any]]) -> dict[str, str]:
    """The Docker-link variables a kubelet sets for each Service with a ClusterIP (but the API
    server's own, see apiserver_env)."""
    env: dict[str, str] = {}
    for service in sorted(services, key=lambda s: s["metadata"]["name"]):
        ip, ports = service["spec"].get("clusterIP"), service["spec"].get("ports") or []
        if not ip or ip == "None" or not ports or (
                service["metadata"]["name"], service["metadata"]["namespace"]) == (
                "kubernetes", "default"):
            continue
        prefix = service["metadata"]["name"].upper().replace("-", "_")
        env[f"{prefix}_SERVICE_HOST"] = ip
        env[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
        env[f"{prefix}_PORT"] = f"{ports[0].get('protocol', 'TCP').lower()}://{ip}:{ports[0]['port']}"
        for port in ports:
            protocol, number = port.get("protocol", "TCP"), port["port"]
            if port.get("name"):
                env[f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(number)
            link = f"{prefix}_PORT_{number}_{protocol}"
            env[link] = f"{protocol.lower()}://{ip}:{number}"
            env[f"{link}_PROTO"] = protocol.lower()
            env[f"{link}_PORT"] = str(number)
            env[f"{link}_ADDR"] = ip
    return env


def apiserver_env(port: int) -> dict[str, str]:
    return {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
            "KUBERNETES_PORT": f"tcp://127.0.0.1:{port}",
            f"KUBERNETES_PORT_{port}_TCP": f"tcp://127.0.0.1:{port}",
            f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
            f"KUBERNETES_PORT_{port}_TCP_PORT": str(port),
            f"KUBERNETES_PORT_{port}_TCP_ADDR": "127.0.0.1"}


def _key_ref(ref: dict[str, Any], kind: str, namespace: str, lookup: Lookup) -> str | None:
    obj = lookup(kind, namespace, ref["name"])
    value = _string_data(obj).get(ref["key"]) if obj else None
    if value is None and not ref.get("optional"):
        raise ContainerConfigError(f"{kind} {namespace}/{ref['name']}: no key {ref['key']!r}"
                                   if obj else f"{kind} {namespace}/{ref['name']} not found")
    return value


def _string_data(obj: dict[str, Any]) -> dict[str, str]:
    if obj["kind"] == "Secret":
        return {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
    return dict(obj.get("data") or {})


def _env_from(sources: list[dict[str, Any]], namespace: str, lookup: Lookup) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in sources:
        kind, ref = (("ConfigMap", source["configMapRef"]) if "configMapRef" in source
                     else ("Secret", source["secretRef"]))
        obj = lookup(kind, namespace, ref["name"])
        if obj is None:
            if ref.get("optional"):
                continue
            raise ContainerConfigError(f"{kind} {namespace}/{ref['name']} not found")
        env.update({source.get("prefix", "") + k: v for k, v in _string_data(obj).items()})
    return env


def container_env(pod: dict[str, Any], container: dict[str, Any], *, image: ImageConfig,
                  paths: HostPaths, home: str, network: PodNetwork,
                  services: list[dict[str, Any]], lookup: Lookup) -> dict[str, str]:
    namespace = pod["metadata"]["namespace"]
    env = {key: paths.env_value(value) for key, value in image.env.items()}
    env.update(HOSTNAME=pod["spec"].get("hostname") or pod["metadata"]["name"], HOME=home)
    if pod["spec"].get("enableServiceLinks", True):
        env.update(service_links(services))
    env.update(apiserver_env(network.apiserver_port))
    env.update(_env_from(container.get("envFrom") or [], namespace, lookup))
    for var in container.get("env") or []:
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = expand(var.get("value", ""), env)
        elif "fieldRef" in source:
            env[var["name"]] = field_ref(pod, source["fieldRef"]["fieldPath"], network)
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind = "ConfigMap" if "configMapKeyRef" in source else "Secret"
            value = _key_ref(source.get("configMapKeyRef") or source["secretKeyRef"], kind,
                             namespace, lookup)
            if value is not None:
                env[var["name"]] = value
        else:
            raise ContainerConfigError(f"env {var['name']}: {sorted(source)} is not emulated "
                                       "by the process kubelet")
    return env


def container_argv(container: dict[str, Any], image: ImageConfig, paths: HostPaths,
                   env: dict[str, str]) -> list[str]:
    """command + args, or the image's ENTRYPOINT + (args or CMD); then $(VAR) and host paths."""
    args = container.get("args")
    if container.get("command"):
        argv = [*container["command"], *(args or [])]
    else:
        argv = [*image.entrypoint, *(image.cmd if args is None else args)]
    if not argv:
        raise ContainerConfigError("no command: the container has none and the image neither")
    return paths.command([expand(word, env) for word in argv])
