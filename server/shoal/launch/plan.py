"""The launch plan: which components this node runs, with their command lines and environment.

`shoal serve` runs the plan as child processes; `shoal supervisord-conf` renders the same plan as a
supervisord config. One plan, two runners.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field

from shoal.config import ServerArgs, env_name, scheduler_name, to_argv
from shoal.ports import free_port

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's multiprocess directory


@dataclass(frozen=True)
class ComponentSpec:
    name: str                  # also the process title suffix: shoal::<name>
    argv: tuple[str, ...]
    rank: int | None = None    # global rank of a scheduler
    env: dict[str, str] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return f"shoal::{self.name}"


@dataclass(frozen=True)
class LaunchPlan:
    run_dir: str
    components: tuple[ComponentSpec, ...]


def resolve_launch_args(args: ServerArgs) -> ServerArgs:
    """What a runner decides before building its plan: a local rendezvous for the ranks of a
    one-node server when `--dist-init-addr` is not given."""
    if args.world_size > 1 and args.dist_init_addr is None:
        return dataclasses.replace(args, dist_init_addr=f"127.0.0.1:{free_port()}")
    return args


def build_plan(args: ServerArgs, run_dir: str, python: str = sys.executable) -> LaunchPlan:
    flags = to_argv(dataclasses.replace(args, api_key=None))  # secrets stay out of `ps`

    env = {METRICS_DIR_ENV: os.path.join(run_dir, "metrics")}
    if args.api_key:
        env[env_name("api_key")] = args.api_key

    def component(name: str, role: str, *extra: str, rank: int | None = None) -> ComponentSpec:
        argv = (python, "-m", "shoal", "component", role, "--run-dir", run_dir, *extra, *flags)
        return ComponentSpec(name=name, argv=argv, rank=rank, env=env)

    components = []
    if args.node_rank == 0:
        components.append(component("api", "api"))
        components.append(component("detokenizer", "detokenizer"))
    for pp_rank, tp_rank in args.local_ranks():
        components.append(component(scheduler_name(pp_rank, tp_rank, args.pp), "scheduler",
                                    "--pp-rank", str(pp_rank), "--tp-rank", str(tp_rank),
                                    rank=pp_rank * args.tp + tp_rank))
    return LaunchPlan(run_dir=run_dir, components=tuple(components))
