"""The command line of `shoal router` (DESIGN: `--host --port --policy` with `--worker`, or
`--prefill`/`--decode`, or `--service NAME:PORT`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

API_KEY_ENV = "SHOAL_API_KEY"  # the key from the environment: out of `ps` and the pod's args
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
DEFAULT_ROUTER_PORT = 8000


@dataclass(frozen=True)
class RouterArgs:
    host: str = "127.0.0.1"
    port: int = DEFAULT_ROUTER_PORT
    policy: str = "cache_aware"
    workers: tuple[str, ...] = ()    # colocated servers (URLs)
    prefills: tuple[str, ...] = ()   # prefill servers (URLs)
    decodes: tuple[str, ...] = ()    # decode servers (URLs)
    services: tuple[str, ...] = ()   # NAME:PORT of headless Services: servers of any mode
    health_check_interval: float = 2.0
    health_failure_threshold: int = 2
    max_retries: int = 2
    request_timeout: float = 1800.0
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**24   # characters remembered per worker (cache_aware)
    api_key: str | None = None
    log_level: str = "info"

    def problems(self) -> list[str]:
        found = []
        if not (self.workers or self.prefills or self.decodes or self.services):
            found.append("give workers: --worker URL, --prefill URL and --decode URL, or "
                         "--service NAME:PORT")
        if bool(self.prefills) != bool(self.decodes):
            found.append("--prefill and --decode go together")
        if self.policy not in POLICIES:
            found.append(f"--policy must be one of {', '.join(POLICIES)}")
        if not 1 <= self.port <= 65535:
            found.append("--port must be in [1, 65535]")
        if self.health_check_interval <= 0 or self.health_failure_threshold < 1:
            found.append("--health-check-interval must be > 0, "
                         "--health-failure-threshold >= 1")
        if self.max_retries < 0:
            found.append("--max-retries must be >= 0")
        for service in self.services:
            name, _, port = service.rpartition(":")
            if not name or not port.isdigit():
                found.append(f"--service {service}: expected NAME:PORT")
        return found


def add_router_flags(parser: argparse.ArgumentParser) -> None:
    defaults = RouterArgs()
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--policy", default=defaults.policy, choices=POLICIES)
    parser.add_argument("--worker", action="append", default=[], dest="workers",
                        metavar="URL", help="a colocated server (repeatable)")
    parser.add_argument("--prefill", action="append", default=[], dest="prefills",
                        metavar="URL", help="a prefill server (repeatable; its bootstrap port "
                        "is read from its /server_info)")
    parser.add_argument("--decode", action="append", default=[], dest="decodes",
                        metavar="URL", help="a decode server (repeatable)")
    parser.add_argument("--service", action="append", default=[], dest="services",
                        metavar="NAME:PORT", help="servers of a headless Service, by its DNS "
                        "records (re-resolved every few seconds; each server's mode from its "
                        "/server_info)")
    parser.add_argument("--health-check-interval", type=float,
                        default=defaults.health_check_interval, help="seconds")
    parser.add_argument("--health-failure-threshold", type=int,
                        default=defaults.health_failure_threshold,
                        help="failed checks in a row that take a worker out")
    parser.add_argument("--max-retries", type=int, default=defaults.max_retries,
                        help="other workers tried before the first byte reaches the client")
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout,
                        help="seconds")
    parser.add_argument("--cache-threshold", type=float, default=defaults.cache_threshold,
                        help="cache_aware: share of a prompt matched to stay on its worker")
    parser.add_argument("--balance-abs-threshold", type=int,
                        default=defaults.balance_abs_threshold,
                        help="cache_aware: in-flight gap (and ...)")
    parser.add_argument("--balance-rel-threshold", type=float,
                        default=defaults.balance_rel_threshold,
                        help="cache_aware: ... ratio) beyond which the least loaded worker wins")
    parser.add_argument("--max-tree-size", type=int, default=defaults.max_tree_size,
                        help="cache_aware: prompt characters remembered per worker")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help="require `Authorization: Bearer KEY` (forwarded to the workers, "
                             f"and sent on the router's own calls to them; env: {API_KEY_ENV})")
    parser.add_argument("--log-level", default=defaults.log_level)


def router_args_from_namespace(ns: argparse.Namespace) -> RouterArgs:
    return RouterArgs(
        host=ns.host, port=ns.port, policy=ns.policy, workers=tuple(ns.workers),
        prefills=tuple(ns.prefills), decodes=tuple(ns.decodes), services=tuple(ns.services),
        health_check_interval=ns.health_check_interval,
        health_failure_threshold=ns.health_failure_threshold, max_retries=ns.max_retries,
        request_timeout=ns.request_timeout, cache_threshold=ns.cache_threshold,
        balance_abs_threshold=ns.balance_abs_threshold,
        balance_rel_threshold=ns.balance_rel_threshold, max_tree_size=ns.max_tree_size,
        api_key=ns.api_key, log_level=ns.log_level)
