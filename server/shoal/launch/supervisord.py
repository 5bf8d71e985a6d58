"""`shoal supervisord-conf`: the launch plan rendered as a supervisord config.

The same plan `shoal serve` runs, as one `[program:NAME]` per component (logging to supervisord's
stdout/stderr, never restarted), plus an `[eventlistener:exit_listener]` (image/exit_listener.py)
that stops the whole server when any program exits or goes FATAL, and records which one.

Start and stop order come from `priority`. supervisord starts lower priorities first and stops
higher priorities first, one group at a time, waiting for a group to be stopped (up to its
`stopwaitsecs`, then SIGKILL) before stopping the next:

    priority  group / program    stop
    -1        exit_listener      last
    100       schedulers         every rank at once: one group, so no rank is left alone in a
                                 collective and mistakes the stop for a lost peer
    200       detokenizer
    300       api                first, with the drain timeout: uvicorn stops accepting and
                                 finishes in-flight requests while the engine still runs
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shoal.config import ServerArgs
from shoal.launch.plan import ComponentSpec, LaunchPlan, build_plan, resolve_launch_args
from shoal.launch.supervise import DRAIN_TIMEOUT_S, GRACE_S

SCHEDULER_GROUP = "schedulers"
LISTENER_NAME = "exit_listener"
PRIORITIES = {SCHEDULER_GROUP: 100, "detokenizer": 200, "api": 300}
LISTENER_PRIORITY = -1
LISTENER_EVENTS = ("PROCESS_STATE_RUNNING", "PROCESS_STATE_EXITED", "PROCESS_STATE_FATAL")
# Where the image installs the listener; `--exit-listener` or SHOAL_EXIT_LISTENER elsewhere.
DEFAULT_EXIT_LISTENER = "/opt/shoal/image/exit_listener.py"

_INLINE_COMMENT = re.compile(r"\s[;#]")  # supervisord's ini parser cuts a value there


@dataclass(frozen=True)
class SupervisordFiles:
    """supervisord's own files, kept in the server's private run directory."""

    run_dir: str

    def _path(self, name: str) -> str:
        return str(Path(self.run_dir) / name)

    @property
    def conf(self) -> str:
        return self._path("supervisord.conf")

    @property
    def log(self) -> str:  # supervisord's main log (also on its stdout); the listener reads it
        return self._path("supervisord.log")

    @property
    def socket(self) -> str:
        return self._path("supervisord.sock")

    @property
    def pidfile(self) -> str:
        return self._path("supervisord.pid")

    @property
    def exit_record(self) -> str:  # written by the listener: which program failed, and how
        return self._path("exit.json")


@dataclass(frozen=True)
class SupervisordOptions:
    exit_listener: tuple[str, ...]       # argv of the listener, before the flags added here
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    stop_grace_s: float = GRACE_S


def render_supervisord_conf(plan: LaunchPlan, options: SupervisordOptions) -> str:
    """The supervisord config that runs `plan` (a pure function of its arguments)."""
    files = SupervisordFiles(plan.run_dir)
    sections = [
        ("supervisord", {"nodaemon": "true", "logfile": files.log, "logfile_maxbytes": "10MB",
                         "logfile_backups": "1", "loglevel": "info", "pidfile": files.pidfile,
                         "childlogdir": plan.run_dir, "identifier": "shoal"}),
        ("unix_http_server", {"file": files.socket, "chmod": "0700"}),
        ("rpcinterface:supervisor",
         {"supervisor.rpcinterface_factory": "supervisor.rpcinterface:make_main_rpcinterface"}),
        ("supervisorctl", {"serverurl": f"unix://{files.socket}"}),
    ]
    schedulers = [spec.name for spec in plan.components if spec.rank is not None]
    for spec in plan.components:
        sections.append((f"program:{spec.name}", _program(spec, options)))
    if schedulers:
        sections.append((f"group:{SCHEDULER_GROUP}",
                         {"programs": ",".join(schedulers),
                          "priority": str(PRIORITIES[SCHEDULER_GROUP])}))
    sections.append((f"eventlistener:{LISTENER_NAME}", _listener(plan, files, options)))
    header = "; rendered by `shoal supervisord-conf` from the launch plan; do not edit\n"
    return header + "".join(_section(name, values) for name, values in sections)


def _program(spec: ComponentSpec, options: SupervisordOptions) -> dict[str, str]:
    is_api = spec.name == "api"
    values = {
        "command": command_line(spec.argv),
        "priority": str(PRIORITIES.get(spec.name, PRIORITIES[SCHEDULER_GROUP])),
        "autostart": "true",
        "autorestart": "false",  # any exit ends the server (the listener sees it)
        "startsecs": "0",        # so every exit is an EXITED event, never a silent BACKOFF
        "startretries": "0",
        "stopsignal": "TERM",
        "stopwaitsecs": str(_seconds(options.drain_timeout_s if is_api else options.stop_grace_s)),
        "stopasgroup": "true",
        "killasgroup": "true",
        **_stdio_to_supervisord(),
    }
    if spec.env:
        values["environment"] = environment_line(spec.env)
    return values


def _listener(plan: LaunchPlan, files: SupervisordFiles,
              options: SupervisordOptions) -> dict[str, str]:
    argv = [*options.exit_listener, "--record", files.exit_record,
            "--supervisord-log", files.log, "--grace", str(options.stop_grace_s)]
    for spec in plan.components:
        argv += ["--component", spec.name if spec.rank is None else f"{spec.name}={spec.rank}"]
    return {
        "command": command_line(argv),
        "events": ",".join(LISTENER_EVENTS),
        "buffer_size": "1024",
        "priority": str(LISTENER_PRIORITY),
        "autostart": "true",
        "autorestart": "false",
        "startsecs": "0",
        "startretries": "0",
        "stopwaitsecs": str(_seconds(options.stop_grace_s) + 5),
        "stdout_logfile": "NONE",  # stdout is the event protocol
        "stderr_logfile": "/dev/stderr",
        "stderr_logfile_maxbytes": "0",
    }


def _stdio_to_supervisord() -> dict[str, str]:
    return {"stdout_logfile": "/dev/stdout", "stdout_logfile_maxbytes": "0",
            "stderr_logfile": "/dev/stderr", "stderr_logfile_maxbytes": "0"}


def _section(name: str, values: dict[str, str]) -> str:
    lines = [f"[{name}]"] + [f"{key}={value}" for key, value in values.items()]
    return "\n" + "\n".join(lines) + "\n"


def _seconds(value: float) -> int:
    return max(1, round(value))


def command_line(argv: Sequence[str]) -> str:
    """`argv` as a `command=` value: supervisord splits it with `shlex.split` after expanding
    `%(name)s`, and its ini parser ends a value at whitespace followed by `;` or `#`."""
    return " ".join(_word(arg) for arg in argv)


def _word(arg: str) -> str:
    _check_one_line(arg)
    word = shlex.quote(arg)
    if _INLINE_COMMENT.search(word):
        # NOTE: outside quotes, shlex keeps a backslash-escaped character literally, and a `;`
        # or `#` right after a backslash does not start a comment.
        word = "".join(c if c.isalnum() else "\\" + c for c in arg)
    return word.replace("%", "%%")


def environment_line(env: dict[str, str]) -> str:
    """`env` as an `environment=` value (supervisord's own KEY="value",... syntax, which has no
    escapes: values with quotes, or with a `;`/`#` after whitespace, cannot be expressed)."""
    pairs = []
    for key, value in env.items():
        _check_one_line(value)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"environment variable name {key!r} cannot go into a supervisord "
                             "config")
        if '"' in value or "'" in value or _INLINE_COMMENT.search(value):
            raise ValueError(f"the value of {key} cannot go into a supervisord config: {value!r}")
        pairs.append(f'{key}="{value}"'.replace("%", "%%"))
    return ",".join(pairs)


def _check_one_line(text: str) -> None:
    if "\n" in text or "\r" in text or "\0" in text:
        raise ValueError(f"a line break cannot go into a supervisord config: {text!r}")


def add_supervisord_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", default=None,
                        help="the server's private run directory (IPC sockets, supervisord "
                             "files; default: a new one under the system's temp directory)")
    parser.add_argument("--exit-listener", default=None,
                        help="path of image/exit_listener.py (default: $SHOAL_EXIT_LISTENER, "
                             f"else {DEFAULT_EXIT_LISTENER})")
    parser.add_argument("--output", default=None, help="write the config here, not to stdout")


def supervisord_conf_main(args: ServerArgs, ns: argparse.Namespace,
                          environ: dict[str, str] | None = None) -> int:
    """`shoal supervisord-conf`: render the plan for `args` into a config."""
    from shoal.ipc.sockets import make_run_dir

    environ = dict(os.environ) if environ is None else environ
    listener = ns.exit_listener or environ.get("SHOAL_EXIT_LISTENER", DEFAULT_EXIT_LISTENER)
    run_dir = make_run_dir(ns.run_dir) if ns.run_dir else tempfile.mkdtemp(prefix="shoal-")
    plan = build_plan(resolve_launch_args(args), run_dir)
    text = render_supervisord_conf(plan, SupervisordOptions(
        exit_listener=(sys.executable, listener)))
    if ns.output:
        Path(ns.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
