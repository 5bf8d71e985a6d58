"""The `shoal` command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import tempfile

from shoal import model_store
from shoal.bench import add_bench_commands, bench_main
from shoal.config import (ComponentArgs, ConfigError, ServerArgs, add_server_flags,
                          server_args_from_namespace)
from shoal.launch.supervisord import add_supervisord_flags
from shoal.lifecycle import ExitCode
from shoal.ports import free_port


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run an OpenAI-compatible server")
    add_server_flags(serve)

    conf = commands.add_parser("supervisord-conf",
                               help="render the launch plan as a supervisord config")
    add_server_flags(conf)
    add_supervisord_flags(conf)

    component = commands.add_parser("component", help="run one component of a server")
    component.add_argument("role", choices=("api", "detokenizer", "scheduler"))
    component.add_argument("--run-dir", required=True)
    component.add_argument("--pp-rank", type=int, default=0)
    component.add_argument("--tp-rank", type=int, default=0)
    add_server_flags(component)

    model = commands.add_parser("model", help="embedded models")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    prepare = model_commands.add_parser("prepare", help="convert an embedded model once; "
                                        "prints its folder as the last line")
    prepare.add_argument("name", nargs="?", default=model_store.DEFAULT_MODEL)
    model_commands.add_parser("list", help="embedded models and whether they are prepared")
    add_bench_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    ns = _parser().parse_args(argv)
    if ns.command == "model":
        sys.exit(_model(ns))
    if ns.command == "bench":
        sys.exit(bench_main(ns))
    try:
        args = server_args_from_namespace(ns)
    except ConfigError as exc:
        print(f"shoal: configuration error: {exc}", file=sys.stderr)
        sys.exit(ExitCode.STARTUP_FAILED)
    if ns.command == "serve":
        sys.exit(_serve(args))
    if ns.command == "supervisord-conf":
        from shoal.launch.supervisord import supervisord_conf_main
        sys.exit(supervisord_conf_main(args, ns))
    from shoal.launch.component import run_component
    run_component(ns.role, args, ComponentArgs(run_dir=ns.run_dir, pp_rank=ns.pp_rank,
                                               tp_rank=ns.tp_rank))


def _serve(args: ServerArgs) -> int:
    from shoal.ipc.sockets import make_run_dir
    from shoal.launch.node_health import serve_node_health
    from shoal.launch.plan import build_plan
    from shoal.launch.supervise import PlanRunner

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s [serve] %(levelname)s %(name)s: %(message)s")
    if args.model_path is None:
        model_store.prepare()  # once, before the components race to do it
    if args.world_size > 1 and args.dist_init_addr is None:
        args = dataclasses.replace(args, dist_init_addr=f"127.0.0.1:{free_port()}")
    with tempfile.TemporaryDirectory(prefix="shoal-") as run_dir:
        runner = PlanRunner(build_plan(args, make_run_dir(run_dir)))
        if args.node_rank > 0:
            serve_node_health(args.host, args.port, runner.all_alive)
        return runner.run()


def _model(ns: argparse.Namespace) -> int:
    if ns.model_command == "list":
        for name, installed, prepared in model_store.list_models():
            state = "prepared" if prepared else ("installed" if installed else "not installed")
            print(f"{name}\t{state}\t{model_store.prepared_dir(name)}")
        return 0
    try:
        print(model_store.prepare(ns.name))
    except model_store.ModelNotAvailable as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 1
    return 0
