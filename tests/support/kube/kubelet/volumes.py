"""A pod's volumes as folders on this machine, and a container's volumeMounts as bind mounts.

emptyDir, configMap, secret, downwardAPI and projected volumes (the ServiceAccount token volume
admission adds is one: a TokenRequest token, kube-root-ca.crt and the namespace) are written
under the pod's folder once, when the pod starts; hostPath is the path itself; a
persistentVolumeClaim is the hostPath or local path of the PersistentVolume it is bound to.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from tests.support.kube.kubelet.api import KubeApi
from tests.support.kube.kubelet.environment import ContainerConfigError, PodNetwork, field_ref

DEFAULT_MODE = 0o644


def _write_files(folder: Path, files: dict[str, bytes], mode: int) -> None:
    for relative, content in files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(mode)


def _object_files(api: KubeApi, kind: str, namespace: str, source: dict[str, Any]) -> dict[
        str, bytes]:
    obj = api.get(kind, namespace, source["name"])
    if obj is None:
        if source.get("optional"):
            return {}
        raise ContainerConfigError(f'{kind.lower()} "{source["name"]}" not found')
    if kind == "Secret":
        data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    else:
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    items = source.get("items")
    if not items:
        return data
    missing = [item["key"] for item in items if item["key"] not in data]
    if missing and not source.get("optional"):
        raise ContainerConfigError(f"{kind.lower()} {source['name']} has no key {missing[0]!r}")
    return {item["path"]: data[item["key"]] for item in items if item["key"] in data}


def _downward_files(pod: dict[str, Any], items: list[dict[str, Any]],
                    network: PodNetwork) -> dict[str, bytes]:
    files = {}
    for item in items:
        if "fieldRef" not in item:
            raise ContainerConfigError(f"downwardAPI {sorted(item)} is not emulated")
        files[item["path"]] = field_ref(pod, item["fieldRef"]["fieldPath"], network).encode()
    return files


def _projected_files(api: KubeApi, pod: dict[str, Any], sources: list[dict[str, Any]],
                     network: PodNetwork) -> dict[str, bytes]:
    namespace = pod["metadata"]["namespace"]
    files: dict[str, bytes] = {}
    for source in sources:
        if "serviceAccountToken" in source:
            token = source["serviceAccountToken"]
            files[token["path"]] = api.request_token(
                pod, pod["spec"].get("serviceAccountName") or "default", token.get("audience"),
                token.get("expirationSeconds")).encode()
        elif "configMap" in source:
            files.update(_object_files(api, "ConfigMap", namespace, source["configMap"]))
        elif "secret" in source:
            files.update(_object_files(api, "Secret", namespace, source["secret"]))
        elif "downwardAPI" in source:
            files.update(_downward_files(pod, source["downwardAPI"].get("items") or [], network))
        else:
            raise ContainerConfigError(f"projected source {sorted(source)} is not emulated")
    return files


def _claimed_path(api: KubeApi, namespace: str, claim: str) -> Path:
    pvc = api.get("PersistentVolumeClaim", namespace, claim)
    if pvc is None:
        raise ContainerConfigError(f'persistentvolumeclaim "{claim}" not found')
    volume_name = pvc["spec"].get("volumeName")
    pv = api.get("PersistentVolume", None, volume_name) if volume_name else None
    if pv is None or pvc.get("status", {}).get("phase") != "Bound":
        raise ContainerConfigError(f'persistentvolumeclaim "{claim}" is not bound')
    source = pv["spec"].get("hostPath") or pv["spec"].get("local")
    if source is None:
        raise ContainerConfigError(f"PersistentVolume {volume_name}: only hostPath and local "
                                   "volumes are emulated")
    return Path(source["path"])


def _host_path(source: dict[str, Any]) -> Path:
    path, kind = Path(source["path"]), source.get("type", "")
    if kind == "DirectoryOrCreate":
        path.mkdir(parents=True, exist_ok=True)
    elif kind == "FileOrCreate" and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    elif kind in ("Directory", "File") and not path.exists():
        raise ContainerConfigError(f"hostPath {path} ({kind}) does not exist")
    return path


def prepare_volumes(api: KubeApi, pod: dict[str, Any], volumes_dir: Path,
                    network: PodNetwork) -> dict[str, Path]:
    """Volume name -> the folder (or file) on this machine that holds it."""
    namespace = pod["metadata"]["namespace"]
    prepared: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes") or []:
        name, folder = volume["name"], volumes_dir / volume["name"]
        if "hostPath" in volume:
            prepared[name] = _host_path(volume["hostPath"])
            continue
        if "persistentVolumeClaim" in volume:
            prepared[name] = _claimed_path(api, namespace,
                                           volume["persistentVolumeClaim"]["claimName"])
            continue
        if "emptyDir" in volume:
            files: dict[str, bytes] = {}
        elif "configMap" in volume or "secret" in volume:
            kind = "ConfigMap" if "configMap" in volume else "Secret"
            source = volume.get("configMap") or {**volume["secret"],
                                                 "name": volume["secret"]["secretName"]}
            files = _object_files(api, kind, namespace, source)
        elif "downwardAPI" in volume:
            files = _downward_files(pod, volume["downwardAPI"].get("items") or [], network)
        elif "projected" in volume:
            files = _projected_files(api, pod, volume["projected"].get("sources") or [], network)
        else:
            kinds = sorted(set(volume) - {"name"})
            raise ContainerConfigError(f"volume {name}: {kinds} is not emulated")
        folder.mkdir(parents=True, exist_ok=True)
        mode = next((volume[k].get("defaultMode") for k in volume if k != "name"
                     and isinstance(volume[k], dict) and "defaultMode" in volume[k]),
                    DEFAULT_MODE)
        _write_files(folder, files, mode)
        prepared[name] = folder
    return prepared


def volume_binds(container: dict[str, Any], volumes: dict[str, Path]) -> list[dict[str, Any]]:
    """The container's volumeMounts as sandbox bind mounts, parents before children."""
    binds = []
    for mount in container.get("volumeMounts") or []:
        if mount["name"] not in volumes:
            raise ContainerConfigError(f"volumeMount {mount['name']}: no such volume")
        source = volumes[mount["name"]]
        if mount.get("subPath"):
            source = source / mount["subPath"]
            if not source.exists():
                source.mkdir(parents=True)
        binds.append({"source": str(source), "target": mount["mountPath"],
                      "read_only": bool(mount.get("readOnly"))})
    return sorted(binds, key=lambda b: len(Path(b["target"]).parts))
