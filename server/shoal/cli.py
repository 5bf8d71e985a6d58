"""The `shoal` command line.

A command that starts a server or a piece of one (`serve`, `component`, `supervisord-conf`) and
is given a flag value that cannot work exits 88 (`startup-failed`) with a termination message,
as the image's entrypoint does; argparse's own exit 2 is left to the other commands.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Callable
from typing import NoReturn

from shoal import model_store
from shoal.bench import add_bench_commands, bench_main
from shoal.config import (
    ComponentArgs,
    ConfigError,
    ServerArgs,
    add_server_flags,
    server_args_from_namespace,
)
from shoal.launch.component import ROLES
from shoal.launch.supervisord import add_supervisord_flags
from shoal.lifecycle import ExitCode, fail, reset_termination_log
from shoal.router.args import add_router_flags, router_args_from_namespace


class _Parser(argparse.ArgumentParser):
    """argparse, with a hook for the commands whose bad flags are a startup failure."""

    on_error: Callable[[str], NoReturn] | None = None

    def error(self, message: str) -> NoReturn:
        if self.on_error is None:
            super().error(message)
        self.print_usage(sys.stderr)
        self.on_error(message)


def _startup_failed(command: str, detail: str) -> NoReturn:
    """A server command refuses its configuration: exit 88 with a termination message. `serve`
    starts a fresh termination log first (a stale message must not speak for this run); a
    component shares its server's log and only adds to it."""
    print(f"shoal {command}: configuration error: {detail}", file=sys.stderr)
    if command == "serve":
        reset_termination_log()
    fail(ExitCode.STARTUP_FAILED, command, None, f"configuration error: {detail}")


def _server_command(commands: argparse._SubParsersAction, name: str,
                    help: str) -> argparse.ArgumentParser:  # noqa: A002 - argparse's name
    parser = commands.add_parser(name, help=help)
    parser.on_error = lambda message: _startup_failed(name, message)
    add_server_flags(parser)
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shoal", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _server_command(commands, "serve", "run an OpenAI-compatible server")
    add_supervisord_flags(_server_command(commands, "supervisord-conf",
                                          "render the launch plan as a supervisord config"))
    component = _server_command(commands, "component", "run one component of a server")
    component.add_argument("role", choices=ROLES)
    component.add_argument("--run-dir", required=True)
    component.add_argument("--pp-rank", type=int, default=0)
    component.add_argument("--tp-rank", type=int, default=0)

    model = commands.add_parser("model", help="embedded models")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    prepare = model_commands.add_parser("prepare", help="convert an embedded model or a local "
                                        "GGUF file (PATH.gguf) once; prints its folder as the "
                                        "last line")
    prepare.add_argument("name", nargs="?", default=model_store.DEFAULT_MODEL)
    model_commands.add_parser("list", help="embedded models and whether they are prepared")
    add_bench_commands(commands)
    router = commands.add_parser("router", help="one OpenAI-compatible front for colocated "
                                 "servers or prefill/decode pairs (docs/pd.md)")
    router.on_error = lambda message: _startup_failed("router", message)
    add_router_flags(router)
    return parser


def main(argv: list[str] | None = None) -> None:
    ns = _parser().parse_args(argv)
    if ns.command == "model":
        sys.exit(_model(ns))
    if ns.command == "bench":
        sys.exit(bench_main(ns))
    if ns.command == "router":
        sys.exit(_router(ns))
    try:
        args = server_args_from_namespace(ns)
    except ConfigError as exc:
        _startup_failed(ns.command, str(exc))
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
    from shoal.launch.plan import build_plan, resolve_launch_args
    from shoal.launch.supervise import PlanRunner

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s [serve] %(levelname)s %(name)s: %(message)s")
    embedded = model_store.embedded_name(args.model_path)
    if embedded is not None:
        try:
            model_store.prepare(embedded)  # once, before the components race to do it
        except model_store.ModelNotAvailable as exc:
            _startup_failed("serve", str(exc))
    args = resolve_launch_args(args)
    with tempfile.TemporaryDirectory(prefix="shoal-") as run_dir:
        runner = PlanRunner(build_plan(args, make_run_dir(run_dir)))
        if args.node_rank > 0:
            serve_node_health(args.host, args.port, runner.all_alive)
        return runner.run()


def _router(ns: argparse.Namespace) -> int:
    args = router_args_from_namespace(ns)
    problems = args.problems()
    if problems:
        _startup_failed("router", "; ".join(problems))
    from shoal.router.main import run_router

    run_router(args)
    return 0


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
