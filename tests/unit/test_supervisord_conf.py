"""`shoal supervisord-conf` and the exit listener: the rendered config as supervisord itself reads
it, the listener's decisions, and real supervisord runs with stand-in programs (no model)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import psutil
import pytest
from supervisor.options import ServerOptions

from shoal.config import ServerArgs
from shoal.launch.plan import ComponentSpec, LaunchPlan, build_plan
from shoal.launch.supervisord import (
    LISTENER_EVENTS,
    SupervisordFiles,
    SupervisordOptions,
    command_line,
    environment_line,
    render_supervisord_conf,
)
from shoal.lifecycle import ExitCode
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
LISTENER = REPO / "image" / "exit_listener.py"
OPTIONS = SupervisordOptions(exit_listener=(sys.executable, str(LISTENER)), drain_timeout_s=60,
                             stop_grace_s=3)


def _load_listener() -> ModuleType:
    spec = importlib.util.spec_from_file_location("exit_listener", LISTENER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["exit_listener"] = module
    spec.loader.exec_module(module)
    return module


exit_listener = _load_listener()


def _supervisord_view(plan: LaunchPlan, options: SupervisordOptions = OPTIONS) -> ServerOptions:
    """The config as supervisord parses it."""
    path = Path(plan.run_dir) / "supervisord.conf"
    path.write_text(render_supervisord_conf(plan, options))
    parsed = ServerOptions()
    parsed.configfile = str(path)
    parsed.process_config(do_usage=False)
    return parsed


def _groups(parsed: ServerOptions) -> dict[str, object]:
    return {group.name: group for group in parsed.process_group_configs}


def _programs(parsed: ServerOptions) -> dict[str, object]:
    return {pc.name: pc for group in parsed.process_group_configs
            for pc in group.process_configs}


@pytest.mark.parametrize("flags,schedulers", [
    ({"tp": 2}, ["scheduler_TP0", "scheduler_TP1"]),
    ({"pp": 2}, ["scheduler_PP0_TP0", "scheduler_PP1_TP0"]),
    ({}, ["scheduler_TP0"]),
])
def test_one_program_per_component_running_the_plans_argv(tmp_path: Path, flags: dict,
                                                          schedulers: list[str]) -> None:
    plan = build_plan(ServerArgs(**flags, dist_init_addr="127.0.0.1:1234"), str(tmp_path))
    programs = _programs(_supervisord_view(plan))
    assert set(programs) == {"api", "detokenizer", *schedulers, "exit_listener"}
    for spec in plan.components:
        program = programs[spec.name]
        assert shlex.split(program.command) == list(spec.argv)
        assert program.autorestart is False
        assert program.startsecs == 0
        assert program.stopasgroup and program.killasgroup
        assert (program.stdout_logfile, program.stderr_logfile) == ("/dev/stdout", "/dev/stderr")
        assert program.stdout_logfile_maxbytes == program.stderr_logfile_maxbytes == 0


def test_stop_order_api_first_with_the_drain_timeout_then_engine_then_listener(
        tmp_path: Path) -> None:
    plan = build_plan(ServerArgs(tp=2, dist_init_addr="127.0.0.1:1234"), str(tmp_path))
    parsed = _supervisord_view(plan)
    groups = _groups(parsed)
    # supervisord stops the group with the highest priority first, one group at a time
    stop_order = [g.name for g in sorted(groups.values(), key=lambda g: g.priority, reverse=True)]
    assert stop_order == ["api", "detokenizer", "schedulers", "exit_listener"]
    assert [pc.name for pc in groups["schedulers"].process_configs] == ["scheduler_TP0",
                                                                      "scheduler_TP1"]
    programs = _programs(parsed)
    assert programs["api"].stopwaitsecs == 60
    assert {programs[n].stopwaitsecs for n in ("detokenizer", "scheduler_TP0")} == {3}


def test_listener_gets_process_events_and_every_component_with_its_rank(tmp_path: Path) -> None:
    plan = build_plan(ServerArgs(tp=2, dist_init_addr="127.0.0.1:1234"), str(tmp_path))
    parsed = _supervisord_view(plan)
    pool = _groups(parsed)["exit_listener"]
    argv = shlex.split(pool.process_configs[0].command)
    assert argv[:2] == [sys.executable, str(LISTENER)]
    components = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--component"]
    assert components == ["api", "detokenizer", "scheduler_TP0=0", "scheduler_TP1=1"]
    assert argv[argv.index("--record") + 1] == SupervisordFiles(str(tmp_path)).exit_record
    assert argv[argv.index("--supervisord-log") + 1] == parsed.logfile
    assert {e.__name__ for e in pool.pool_events} == {
        "ProcessStateRunningEvent", "ProcessStateExitedEvent", "ProcessStateFatalEvent"}
    assert len(LISTENER_EVENTS) == 3
    assert parsed.nodaemon is True


def test_node_rank_above_zero_runs_only_its_ranks(tmp_path: Path) -> None:
    args = ServerArgs(tp=2, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    programs = _programs(_supervisord_view(build_plan(args, str(tmp_path))))
    assert set(programs) == {"scheduler_TP1", "exit_listener"}


@pytest.mark.parametrize("arg", ["plain", "", "50%", "%(here)s", "a ;b", "x #y", "semi;colon",
                                 "it's", 'say "hi"', "$HOME", "tab\there", "back\\slash",
                                 "ünïcode ; #"])
def test_any_argument_survives_supervisord_parsing(tmp_path: Path, arg: str) -> None:
    argv = ("/bin/echo", "--served-model-name", arg, "--last")
    plan = LaunchPlan(run_dir=str(tmp_path), components=(ComponentSpec("api", argv),))
    assert shlex.split(_programs(_supervisord_view(plan))["api"].command) == list(argv)


def test_environment_round_trips_or_is_refused(tmp_path: Path) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_DEBUG": "INFO", "RATIO": "50%", "EMPTY": ""}
    argv = ("/bin/true",)
    plan = LaunchPlan(run_dir=str(tmp_path), components=(ComponentSpec("api", argv, env=env),))
    assert _programs(_supervisord_view(plan))["api"].environment == env
    for bad in ({"X": 'say "hi"'}, {"X": "a ;b"}, {"X": "two\nlines"}, {"1X": "v"}):
        with pytest.raises(ValueError):
            environment_line(bad)
    with pytest.raises(ValueError):
        command_line(["two\nlines"])


def test_cli_prints_the_config(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shoal", "supervisord-conf", "--tp", "2", "--run-dir",
         str(tmp_path / "run"), "--exit-listener", str(LISTENER)],
        capture_output=True, text=True, check=True).stdout
    assert "[program:scheduler_TP1]" in out and "[eventlistener:exit_listener]" in out
    assert "--dist-init-addr 127.0.0.1:" in out  # a local rendezvous, as `shoal serve` picks
    assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700


def test_cli_without_a_run_dir_picks_a_private_one(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shoal", "supervisord-conf", "--exit-listener", str(LISTENER)],
        capture_output=True, text=True, check=True, env={**os.environ, "TMPDIR": str(tmp_path)}
    ).stdout
    (run_dir,) = {Path(line.split("=", 1)[1]).parent for line in out.splitlines()
                  if line.startswith("logfile=")}
    assert run_dir.parent == tmp_path and run_dir.name.startswith("shoal-")
    assert run_dir.stat().st_mode & 0o777 == 0o700
    assert f"--run-dir {run_dir}" in out


# --- the listener's decisions -------------------------------------------------------------

SUPERVISORD_LOG = """\
2026-01-01 10:00:00,000 INFO spawned: 'scheduler_TP0' with pid 10
2026-01-01 10:00:01,000 WARN exited: scheduler_TP0 (exit status 75; not expected)
2026-01-01 10:00:01,100 WARN exited: scheduler_TP1 (terminated by SIGKILL; not expected)
2026-01-01 10:00:02,000 WARN exited: scheduler_TP10 (exit status 86; not expected)
2026-01-01 10:00:03,000 WARN exited: api (terminated by SIGSEGV (core dumped); not expected)
"""


@pytest.mark.parametrize("name,status", [("scheduler_TP0", 75), ("scheduler_TP1", "SIGKILL"),
                                         ("scheduler_TP10", 86), ("api", "SIGSEGV"),
                                         ("detokenizer", None)])
def test_exit_status_comes_from_supervisords_log(name: str, status: int | str | None) -> None:
    assert exit_listener.exit_status_from_log(SUPERVISORD_LOG, name) == status


def test_the_last_exit_in_the_log_counts() -> None:
    log = SUPERVISORD_LOG + "x WARN exited: scheduler_TP0 (exit status 1; not expected)\n"
    assert exit_listener.exit_status_from_log(log, "scheduler_TP0") == 1


def test_fatal_is_a_startup_failure() -> None:
    fatal = exit_listener.ExitListener({"api": None}, Path("r"), Path("l"), 1.0).on_event(
        "PROCESS_STATE_FATAL", {"processname": "api"})
    assert fatal is not None and fatal.exit_code == ExitCode.STARTUP_FAILED


def test_event_channel_speaks_the_listener_protocol() -> None:
    read_fd, write_fd = os.pipe()
    out_r, out_w = os.pipe()
    with os.fdopen(out_w, "w") as out, os.fdopen(out_r) as supervisord_side:
        channel = exit_listener.EventChannel(read_fd, out)
        assert channel.next_event(timeout=0.05) is None
        assert channel.next_event(timeout=0.05) is None  # still READY: not announced twice
        payload = "processname:api groupname:api from_state:RUNNING expected:0 pid:42"
        header = f"ver:3.0 server:supervisor serial:1 pool:exit_listener poolserial:1 " \
                 f"eventname:PROCESS_STATE_EXITED len:{len(payload)}\n"
        os.write(write_fd, (header + payload).encode())
        event = channel.next_event(timeout=1)
        assert event is not None
        assert event[0]["eventname"] == "PROCESS_STATE_EXITED"
        assert exit_listener.parse_tokens(event[1])["pid"] == "42"
        channel.ok()
        out.flush()
        os.close(write_fd)
        assert os.read(supervisord_side.fileno(), 100) == b"READY\nRESULT 2\nOK"
        with pytest.raises(EOFError):
            channel.next_event(timeout=1)
    os.close(read_fd)


# --- real supervisord, stand-in programs ---------------------------------------------------

STAND_IN = textwrap.dedent("""\
    import os, signal, sys, time
    name, log, stop_delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    def on_term(signum, frame):
        with open(log, "a") as f:
            f.write(f"{name} sigterm {time.time()}\\n")
        time.sleep(stop_delay)
        with open(log, "a") as f:
            f.write(f"{name} exit {time.time()}\\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    with open(log, "a") as f:
        f.write(f"{name} ready {time.time()}\\n")
    while True:
        time.sleep(0.05)
""")


def _stand_in_plan(run_dir: Path, log: Path, api_stop_delay: float) -> LaunchPlan:
    script = run_dir / "stand_in.py"
    script.write_text(STAND_IN)

    def spec(name: str, rank: int | None, delay: float = 0.0) -> ComponentSpec:
        return ComponentSpec(name, (sys.executable, str(script), name, str(log), str(delay)),
                             rank=rank)
    return LaunchPlan(run_dir=str(run_dir), components=(
        spec("api", None, api_stop_delay), spec("detokenizer", None),
        spec("scheduler_TP0", 0), spec("scheduler_TP1", 1)))


def _run_supervisord(plan: LaunchPlan, env: dict[str, str], log: Path
                     ) -> subprocess.Popen[bytes]:
    """supervisord running `plan`, returned once every stand-in handles SIGTERM."""
    files = SupervisordFiles(plan.run_dir)
    Path(files.conf).write_text(render_supervisord_conf(plan, OPTIONS))
    proc = subprocess.Popen([sys.executable, "-m", "supervisor.supervisord", "--nodaemon",
                             "--configuration", files.conf], env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    def all_ready() -> bool:
        lines = log.read_text().splitlines() if log.exists() else []
        return sum(line.split()[1] == "ready" for line in lines) == len(plan.components)

    try:
        wait_until(all_ready, timeout=30, what="every stand-in program handles SIGTERM")
    except TimeoutError:
        proc.kill()
        raise
    return proc


def _stand_in_pid(proc: subprocess.Popen[bytes], name: str) -> int:
    for child in psutil.Process(proc.pid).children():
        if child.cmdline()[2:3] == [name]:
            return child.pid
    raise LookupError(name)


def test_sigterm_stops_api_first_and_the_engine_only_after_it(tmp_path: Path) -> None:
    log = tmp_path / "events.log"
    plan = _stand_in_plan(tmp_path, log, api_stop_delay=1.5)
    proc = _run_supervisord(plan, {}, log)
    children = psutil.Process(proc.pid).children()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    events = {" ".join(line.split()[:2]): float(line.split()[2])
              for line in log.read_text().splitlines()}
    assert events["api exit"] - events["api sigterm"] >= 1.5
    for name in ("detokenizer", "scheduler_TP0", "scheduler_TP1"):
        assert events[f"{name} sigterm"] >= events["api exit"], name
    assert not Path(SupervisordFiles(plan.run_dir).exit_record).exists()
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_killed_program_stops_everything_and_is_recorded(tmp_path: Path) -> None:
    termination_log = tmp_path / "termination-log"
    log = tmp_path / "events.log"
    plan = _stand_in_plan(tmp_path, log, api_stop_delay=30)  # stuck drain
    proc = _run_supervisord(plan, {"SHOAL_TERMINATION_LOG": str(termination_log)}, log)
    children = psutil.Process(proc.pid).children()
    os.kill(_stand_in_pid(proc, "scheduler_TP1"), signal.SIGKILL)
    started = time.monotonic()
    assert proc.wait(timeout=30) == 0
    # a failed server does not drain: the api, stuck for 30 s, is killed after the grace (3 s);
    # the rest is supervisord stopping the others in order (5-8 s in all on 2 busy cores)
    assert time.monotonic() - started < 20
    record = json.loads(Path(SupervisordFiles(plan.run_dir).exit_record).read_text())
    assert record == {"reason": "crash", "component": "scheduler_TP1", "rank": 1, "exit_code": 137,
                      "detail": "shoal::scheduler_TP1 killed by SIGKILL"}
    message = json.loads(termination_log.read_text())
    assert (message["component"], message["exit_code"], message["reason"]) == (
        "scheduler_TP1", 137, "crash")
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_program_that_cannot_start_is_a_startup_failure(tmp_path: Path) -> None:
    plan = _stand_in_plan(tmp_path, tmp_path / "events.log", api_stop_delay=0)
    broken = ComponentSpec("detokenizer", ("/nonexistent/python", "-m", "shoal"))
    plan = LaunchPlan(plan.run_dir, (plan.components[0], broken, *plan.components[2:]))
    files = SupervisordFiles(plan.run_dir)
    Path(files.conf).write_text(render_supervisord_conf(plan, OPTIONS))
    proc = subprocess.run([sys.executable, "-m", "supervisor.supervisord", "--nodaemon",
                           "--configuration", files.conf], capture_output=True, timeout=60,
                          check=False)
    assert proc.returncode == 0
    record = json.loads(Path(files.exit_record).read_text())
    assert (record["component"], record["exit_code"]) == ("detokenizer", 88)
