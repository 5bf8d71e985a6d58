"""Where `make kube-tools` (tools/k8s/build.sh) put the control plane's binaries."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
TOOLS = REPO / "tools" / "k8s"
TOOLS_GO_MOD = TOOLS / "go.mod"


class MissingBinaries(RuntimeError):
    pass


@dataclass(frozen=True)
class KubeBinaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path


def kubernetes_version(go_mod: str) -> str:
    """The k8s.io/kubernetes version a tools go.mod requires, without the leading v."""
    found = re.search(r"^\s*k8s\.io/kubernetes v(\S+)", go_mod, re.MULTILINE)
    if found is None:
        raise MissingBinaries(f"{TOOLS_GO_MOD} does not require k8s.io/kubernetes")
    return found.group(1)


def build_id() -> str:
    """What tools/k8s/build.sh records in build-id: a hash of the inputs of the build."""
    inputs = b"".join((TOOLS / name).read_bytes() for name in ("build.sh", "go.mod", "go.sum"))
    return hashlib.sha256(inputs).hexdigest()[:16]


def tools_dir() -> Path:
    return Path(os.environ.get("SHOAL_TOOLS_DIR", Path.home() / ".cache" / "shoal-tools"))


def kube_binaries() -> KubeBinaries:
    """The binaries of the version tools/k8s/go.mod pins; a clear error when they are not built."""
    folder = tools_dir() / f"kubernetes-v{kubernetes_version(TOOLS_GO_MOD.read_text())}"
    binaries = KubeBinaries(etcd=folder / "etcd", kube_apiserver=folder / "kube-apiserver",
                            kube_controller_manager=folder / "kube-controller-manager")
    missing = [str(path) for path in vars(binaries).values() if not os.access(path, os.X_OK)]
    if missing:
        raise MissingBinaries(f"the test cluster's binaries are not built ({', '.join(missing)} "
                              "missing): run `make kube-tools` (tools/k8s/build.sh) once")
    built_from = folder / "build-id"
    if not built_from.exists() or built_from.read_text().strip() != build_id():
        raise MissingBinaries(f"the binaries in {folder} were built from other inputs than "
                              "tools/k8s now holds: run `make kube-tools` to rebuild them")
    return binaries
