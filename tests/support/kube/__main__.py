"""python -m tests.support.kube [--state-dir DIR]: the test cluster by hand.

Starts etcd, kube-apiserver, kube-controller-manager and the process kubelet, prints the
KUBECONFIG export line, and runs until Ctrl-C (which stops every pod and component)."""

from __future__ import annotations

import argparse
import signal
import tempfile
import threading
import time
from pathlib import Path

from tests.support.kube.cluster import chart_crds, start_cluster


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.kube")
    parser.add_argument("--state-dir", type=Path,
                        help="keys, kubeconfigs, logs and pod folders (default: a new temp dir)")
    args = parser.parse_args()
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="shoal-kube-"))
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    started = time.monotonic()
    running = start_cluster(state_dir, chart_crds())
    print(f"test cluster up in {time.monotonic() - started:.1f} s; state in {state_dir}")
    print(f"export KUBECONFIG={running.cluster.admin_kubeconfig}", flush=True)
    try:
        while not stop.wait(1.0):
            running.check_running()
    finally:
        print("stopping the test cluster", flush=True)
        running.stop()


if __name__ == "__main__":
    main()
