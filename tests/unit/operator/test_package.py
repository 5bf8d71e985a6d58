"""The operator package: it never imports torch or the engine, its command line, the daemon's
wake-ups, and the status records it reads back."""

from __future__ import annotations

import ast
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

import shoal_operator
from shoal_operator.__main__ import parse_args
from shoal_operator.config import DEFAULT_IMAGE
from shoal_operator.handlers import RESYNC_S, Wakeups, next_pass_in
from shoal_operator.status import Ending, GroupRecord


def test_the_operator_never_imports_torch_or_the_engine() -> None:
    code = ("import json, sys\n"
            "import shoal_operator.__main__, shoal_operator.handlers, shoal_operator.planner\n"
            "print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True,
                                       capture_output=True, text=True).stdout)
    assert "kopf" in loaded and "shoal_operator.planner" in loaded
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "transformers", "numpy", "zmq")]
    assert heavy == []
    assert {m for m in loaded if m.startswith("shoal.")} == {"shoal.lifecycle"}


PURE = ("planner", "failures", "rollout", "conditions", "builders", "spec", "observed", "status",
        "actions", "names", "config", "refusals", "election")


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, dotted (`from a import b` counts as a and a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_only_kube_talks_to_the_api_and_only_the_handlers_know_kopf() -> None:
    """The planner and everything it uses are pure: no client, no kopf, no I/O module."""
    package = Path(shoal_operator.__file__).parent
    modules = {p.stem: _imports(p) for p in package.glob("*.py")}

    def importers(prefix: str) -> set[str]:
        return {m for m, found in modules.items() if any(f.startswith(prefix) for f in found)}

    # the client; the others for its ApiException
    assert importers("kubernetes") == {"kube", "handlers", "leadership", "reconcile"}
    assert importers("kopf") == {"handlers", "__main__"}
    io_modules = {f"shoal_operator.{m}" for m in ("kube", "reconcile", "handlers", "__main__",
                                                  "leadership")}
    for name in PURE:
        assert not modules[name] & io_modules, name


def test_flags_and_their_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse_args([])
    assert args.namespaces == [] and args.default_image == DEFAULT_IMAGE
    assert (args.health_host, args.health_port) == ("0.0.0.0", 8080)
    monkeypatch.setenv("SHOAL_OPERATOR_NAMESPACES", "a, b")
    monkeypatch.setenv("SHOAL_OPERATOR_HEALTH_HOST", "127.0.0.9")
    monkeypatch.setenv("SHOAL_OPERATOR_DEFAULT_IMAGE", "registry/shoal:1")
    args = parse_args(["--health-port", "0"])
    assert args.namespaces == ["a", "b"] and args.health_host == "127.0.0.9"
    assert args.default_image == "registry/shoal:1" and args.health_port == 0
    assert parse_args(["--namespace", "c"]).namespaces == ["c"]  # a flag wins


def test_opt_in_flags_are_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse_args([])
    assert not args.allow_host_path and not args.leader_election
    monkeypatch.setenv("SHOAL_OPERATOR_ALLOW_HOST_PATH", "true")
    monkeypatch.setenv("SHOAL_OPERATOR_LEADER_ELECTION", "true")
    monkeypatch.setenv("SHOAL_OPERATOR_LEADER_ELECTION_NAMESPACE", "ops")
    args = parse_args([])
    assert args.allow_host_path and args.leader_election
    assert (args.leader_election_namespace, args.leader_election_id) == ("ops", "shoal-operator")


class _Stop:
    """Stands in for kopf's DaemonStopped: `await stop.wait()` returns once it is set."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> None:
        await self.event.wait()


def test_a_poke_or_a_stop_wakes_the_daemon_early() -> None:
    async def scenario() -> tuple[float, float, float]:
        wakeups, stop = Wakeups(), _Stop()
        loop = asyncio.get_running_loop()

        async def timed(seconds: float) -> float:
            start = loop.time()
            await wakeups.sleep("ns", "llm", seconds, stop)  # type: ignore[arg-type]
            return loop.time() - start

        loop.call_later(0.05, wakeups.poke, "ns", "llm")
        poked = await timed(5.0)
        slept = await timed(0.05)  # the poke was consumed: a full sleep now
        loop.call_later(0.05, stop.event.set)
        stopped = await timed(5.0)
        return poked, slept, stopped

    poked, slept, stopped = asyncio.run(scenario())
    assert poked < 1.0 and slept >= 0.05 and stopped < 1.0


def test_the_next_pass_comes_at_the_plans_deadline_or_the_resync() -> None:
    assert next_pass_in(None) == RESYNC_S
    assert next_pass_in(3.0) == 3.0
    assert next_pass_in(600.0) == RESYNC_S
    assert 0 < next_pass_in(0.0) < 1  # a zero backoff: at once, but never a busy loop


def test_a_group_record_reads_back_what_it_wrote() -> None:
    record = GroupRecord(name="llm-0", role="engine", replica=0, phase="Failed", restarts=2,
                         last_restart_reason="watchdog", last_restart_time="2026-01-01T00:00:00Z",
                         incarnation=3, generation=2, generation_restarts=1,
                         failed_generation=2, failed_reason="RestartLimitReached",
                         last_termination=Ending("llm-0-1", 1, 86, "watchdog", "scheduler_TP1",
                                                 "stuck"))
    assert GroupRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    assert "recreateAfter" not in record.to_dict()  # unset fields are left out
