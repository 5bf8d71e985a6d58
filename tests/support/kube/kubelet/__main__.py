"""python -m tests.support.kube.kubelet --kubeconfig K --state-dir D --node-name N

Registers the Node, runs pods until SIGTERM/SIGINT, then stops every pod's processes."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

from tests.support.kube.binaries import TOOLS_GO_MOD, kubernetes_version
from tests.support.kube.kubelet.addresses import PodAddresses, claimed_network
from tests.support.kube.kubelet.api import KubeApi
from tests.support.kube.kubelet.container import Backoff
from tests.support.kube.kubelet.image import HostPaths, shoal_image
from tests.support.kube.kubelet.kubelet import Kubelet
from tests.support.kube.kubelet.node import build_node

HOST_IP = "127.0.0.1"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.kube.kubelet")
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--node-name", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(name)s: "
                        "%(message)s")
    for noisy in ("kubernetes", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    args.state_dir.mkdir(parents=True, exist_ok=True)
    api = KubeApi(args.kubeconfig, args.state_dir / "discovery.json")
    version = f"v{kubernetes_version(TOOLS_GO_MOD.read_text())}"
    api.register_node(build_node(args.node_name, HOST_IP, version))
    with claimed_network() as network:
        logging.getLogger("kubelet").info("node %s registered; pod IPs from 127.%d.0.0/16",
                                          args.node_name, network)
        Kubelet(api, root=args.state_dir, node_name=args.node_name, host_ip=HOST_IP,
                addresses=PodAddresses(network), image=shoal_image(),
                paths=HostPaths.of_this_checkout(), backoff=Backoff()).run(stop)


if __name__ == "__main__":
    main()
