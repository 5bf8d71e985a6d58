"""Command lines of the control plane's components (etcd, kube-apiserver, kube-controller-manager).

Everything listens on 127.0.0.1 only. The service CIDR lies outside the private ranges and
nothing ever sends traffic to a ClusterIP here (there is no kube-proxy). There is no scheduler
(the process kubelet binds pods itself) and no node-lifecycle or taint-eviction controller, so a
pod is never evicted from the one Node.
"""

from __future__ import annotations

from pathlib import Path

SERVICE_CIDR = "198.18.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
DISABLED_CONTROLLERS = ("node-lifecycle-controller", "taint-eviction-controller",
                        "device-taint-eviction-controller", "cloud-node-lifecycle-controller",
                        "node-ipam-controller", "node-route-controller", "service-lb-controller",
                        "certificatesigningrequest-signing-controller")


def etcd_argv(binary: Path, data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [str(binary), "--name=shoal-test", f"--data-dir={data_dir}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=shoal-test={peer}", "--unsafe-no-fsync=true",
            "--log-level=warn"]


def apiserver_argv(binary: Path, *, etcd_port: int, port: int, cert_dir: Path, token_file: Path,
                   signing_key: Path) -> list[str]:
    """TLS from a self-signed pair the apiserver writes into `cert_dir` (apiserver.crt holds the
    CA too); static-token authentication; RBAC; ServiceAccount tokens (TokenRequest) signed
    with `signing_key`; the default admission plugins plus OwnerReferencesPermissionEnforcement,
    as hardened clusters run it (setting a blocking owner reference needs `<owner>/finalizers`)."""
    return [str(binary), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={port}", f"--cert-dir={cert_dir}", f"--token-auth-file={token_file}",
            "--authorization-mode=RBAC", f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={signing_key}",
            f"--service-account-signing-key-file={signing_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
            "--endpoint-reconciler-type=none", "--profiling=false"]


def controller_manager_argv(binary: Path, *, kubeconfig: Path, signing_key: Path,
                            ca_file: Path) -> list[str]:
    """Every default controller but the node-lifecycle and cloud ones, each with its own
    ServiceAccount's credentials as in a real cluster; no serving port."""
    controllers = ",".join(["*", *(f"-{name}" for name in DISABLED_CONTROLLERS)])
    return [str(binary), f"--kubeconfig={kubeconfig}", "--leader-elect=false",
            "--secure-port=0", f"--controllers={controllers}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={signing_key}", f"--root-ca-file={ca_file}"]
