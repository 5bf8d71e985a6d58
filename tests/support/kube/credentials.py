"""The test cluster's generated secrets: static bearer tokens, the ServiceAccount signing key,
token kubeconfigs."""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

ADMIN_USER = "shoal-admin"
KUBELET_USER = "shoal-process-kubelet"
# the user the bootstrap RBAC policy grants kube-controller-manager's rights to
CONTROLLER_MANAGER_USER = "system:kube-controller-manager"


@dataclass(frozen=True)
class Tokens:
    admin: str
    controller_manager: str
    kubelet: str

    @classmethod
    def generate(cls) -> Tokens:
        return cls(admin=secrets.token_hex(16), controller_manager=secrets.token_hex(16),
                   kubelet=secrets.token_hex(16))

    def auth_file(self) -> str:
        """kube-apiserver's --token-auth-file: token,user,uid,"groups"."""
        return "".join([
            f'{self.admin},{ADMIN_USER},{ADMIN_USER},"system:masters"\n',
            f"{self.controller_manager},{CONTROLLER_MANAGER_USER},{CONTROLLER_MANAGER_USER}\n",
            f'{self.kubelet},{KUBELET_USER},{KUBELET_USER},"system:masters"\n',
        ])


def write_signing_key(path: Path) -> Path:
    """The RSA key that signs (and verifies) ServiceAccount tokens."""
    subprocess.run(["openssl", "genrsa", "-out", str(path), "2048"], check=True,
                   capture_output=True)
    return path


def write_kubeconfig(path: Path, *, server: str, ca_file: Path, token: str, user: str) -> Path:
    config = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "shoal-test", "cluster": {
            "server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "shoal-test", "context": {"cluster": "shoal-test", "user": user}}],
        "current-context": "shoal-test",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
