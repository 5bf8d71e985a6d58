"""`python -m shoal_operator` / `shoal-operator`: run the operator (kopf, standalone; with
`--leader-election`, one of several replicas reconciles at a time).

Every flag can also come from the environment as SHOAL_OPERATOR_<FLAG> (a flag wins).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import uuid
from pathlib import Path

import kopf

from shoal_operator import handlers
from shoal_operator.config import DEFAULT_IMAGE, OperatorConfig
from shoal_operator.kube import Kube, load_api_client
from shoal_operator.leadership import Leadership
from shoal_operator.metrics import OperatorMetrics

ENV_PREFIX = "SHOAL_OPERATOR_"
POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _env(flag: str, default: str | None = None) -> str | None:
    return os.environ.get(ENV_PREFIX + flag.upper().replace("-", "_"), default)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="shoal-operator", description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", action="append", dest="namespaces",
                        help="watch this namespace (repeatable; default: all namespaces; "
                             "env: comma-separated)")
    parser.add_argument("--default-image", default=_env("default-image", DEFAULT_IMAGE),
                        help="engine image for a ModelDeployment without spec.image")
    parser.add_argument("--cluster-domain", default=_env("cluster-domain", "cluster.local"))
    parser.add_argument("--health-host", default=_env("health-host", "0.0.0.0"),
                        help="address of the liveness endpoint GET /healthz (e.g. the pod IP)")
    parser.add_argument("--health-port", type=int, default=int(_env("health-port", "8080") or 0),
                        help="its port; 0 turns it off")
    parser.add_argument("--metrics-port", type=int,
                        default=int(_env("metrics-port", "0") or 0),
                        help="port of GET /metrics (shoal:operator_*, on --health-host); "
                             "0 (the default) turns it off")
    parser.add_argument("--allow-host-path", action="store_true",
                        default=_env("allow-host-path", "") == "true",
                        help="create pods for ModelDeployments with a hostPath model volume "
                             "(refused otherwise: it mounts a folder of the node)")
    parser.add_argument("--leader-election", action="store_true",
                        default=_env("leader-election", "") == "true",
                        help="run as one of several replicas: only the holder of a "
                             "coordination.k8s.io Lease reconciles")
    parser.add_argument("--leader-election-namespace",
                        default=_env("leader-election-namespace"),
                        help="the Lease's namespace (default: the pod's own)")
    parser.add_argument("--leader-election-id", default=_env("leader-election-id",
                                                             "shoal-operator"),
                        help="the Lease's name")
    parser.add_argument("--log-level", default=_env("log-level", "info"))
    args = parser.parse_args(argv)
    if args.leader_election and not args.leader_election_namespace:
        if not POD_NAMESPACE_FILE.exists():
            parser.error("--leader-election needs --leader-election-namespace outside a pod")
        args.leader_election_namespace = POD_NAMESPACE_FILE.read_text().strip()
    if args.namespaces is None:
        env = _env("namespaces", "") or ""
        args.namespaces = [ns.strip() for ns in env.split(",") if ns.strip()]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s [%(name)s] %(levelname)s: %(message)s")
    if logging.getLogger().level > logging.DEBUG:  # not a line per pod event
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    kube = Kube(load_api_client())
    leadership = Leadership(kube, args.leader_election_namespace, args.leader_election_id,
                            f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}") \
        if args.leader_election else None
    metrics = OperatorMetrics()
    if args.metrics_port:
        metrics.serve(args.health_host, args.metrics_port)
    memo = kopf.Memo(kube=kube, wakeups=handlers.Wakeups(), leadership=leadership,
                     metrics=metrics,
                     config=OperatorConfig(default_image=args.default_image,
                                           cluster_domain=args.cluster_domain,
                                           allow_host_path=args.allow_host_path))
    liveness = (f"http://{args.health_host}:{args.health_port}/healthz"
                if args.health_port else None)
    kopf.run(standalone=True, clusterwide=not args.namespaces, namespaces=args.namespaces,
             liveness_endpoint=liveness, memo=memo)


if __name__ == "__main__":
    main()
