"""Flags, env fallback and the launch plan built from them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shoal.config import (
    ConfigError,
    ServerArgs,
    add_server_flags,
    server_args_from_namespace,
    to_argv,
)
from shoal.engine.threads import RankThreads
from shoal.launch.plan import build_plan
from shoal.scheduler.process import chunked_prefill_size


def parse(argv: list[str], environ: dict[str, str] | None = None) -> ServerArgs:
    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    return server_args_from_namespace(parser.parse_args(argv), environ or {})


def test_defaults() -> None:
    args = parse([])
    assert args.port == 30000 and args.tp == 1 and args.watchdog_timeout == 300
    assert args.disaggregation_bootstrap_port == 8998 and args.model_path is None


def test_the_prefill_chunk_is_chosen_by_device_unless_given() -> None:
    assert chunked_prefill_size(parse([]), torch.device("cpu")) == 512
    assert chunked_prefill_size(parse([]), torch.device("cuda")) == 2048
    given = parse(["--chunked-prefill-size", "300"])
    assert chunked_prefill_size(given, torch.device("cpu")) == 300
    assert chunked_prefill_size(given, torch.device("cuda")) == 300


def test_the_overlap_loop_runs_on_cuda_and_on_cpu_only_when_asked() -> None:
    assert parse([]).use_overlap_schedule("cuda") and not parse([]).use_overlap_schedule("cpu")
    enabled = parse(["--enable-overlap-schedule"])
    assert enabled.use_overlap_schedule("cpu") and enabled.use_overlap_schedule("cuda")
    assert not parse(["--disable-overlap-schedule"]).use_overlap_schedule("cuda")
    assert not parse(["--tp", "2"]).use_overlap_schedule("cuda")  # single-rank only


@pytest.mark.parametrize("ranks", [["--tp", "2"], ["--pp", "2"]])
def test_the_overlap_loop_asked_for_with_several_ranks_is_refused_naming_both(
        ranks: list[str]) -> None:
    with pytest.raises(ConfigError, match="--enable-overlap-schedule: the overlap loop runs on "
                                          "a single-rank server only") as refused:
        parse(["--enable-overlap-schedule", *ranks])
    assert f"{ranks[0]} 2" in str(refused.value)


def test_serve_refusing_the_overlap_loop_with_tp_2_exits_88_with_a_termination_message(
        tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    proc = subprocess.run([sys.executable, "-m", "shoal", "serve", "--enable-overlap-schedule",
                           "--tp", "2"], check=False, capture_output=True, text=True,
                          timeout=120,
                          env={**os.environ, "SHOAL_TERMINATION_LOG": str(log)})
    assert proc.returncode == 88, proc.stderr
    assert "--enable-overlap-schedule: the overlap loop runs on a single-rank server" in \
        proc.stderr
    message = json.loads(log.read_text())
    assert (message["reason"], message["component"], message["exit_code"]) == (
        "startup-failed", "serve", 88)


def test_a_rank_leaves_a_core_free_only_when_asked() -> None:
    assert RankThreads.for_host(2, 1, spare_core=False) == RankThreads(2, 2)
    assert RankThreads.for_host(2, 1, spare_core=True) == RankThreads(1, 2)
    assert RankThreads.for_host(8, 2, spare_core=False) == RankThreads(4, 4)
    assert RankThreads.for_host(2, 2, spare_core=False) == RankThreads(1, 1)
    assert RankThreads.for_host(1, 1, spare_core=True) == RankThreads(1, 1)


def test_env_fallback_and_flag_wins() -> None:
    env = {"SHOAL_PORT": "31000", "SHOAL_TP": "2", "SHOAL_DISABLE_RADIX_CACHE": "true",
           "SHOAL_SCHEDULE_POLICY": "lpm"}
    args = parse(["--tp", "4"], env)
    assert args.port == 31000 and args.tp == 4
    assert args.disable_radix_cache is True and args.schedule_policy == "lpm"


@pytest.mark.parametrize("env", [{"SHOAL_PORT": "x"}, {"SHOAL_SCHEDULE_POLICY": "random"},
                                 {"SHOAL_ENABLE_METRICS": "maybe"}])
def test_bad_env_values_are_config_errors(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        parse([], env)


@pytest.mark.parametrize("argv", [["--tp", "0"], ["--nnodes", "2"], ["--node-rank", "1"],
                                  ["--tp", "3", "--nnodes", "2", "--dist-init-addr", "h:1"],
                                  ["--port", "70000"], ["--max-total-tokens", "1"],
                                  ["--page-size", "16"],
                                  ["--disaggregation-bootstrap-port", "0"],
                                  ["--disaggregation-timeout", "0"],
                                  ["--enable-overlap-schedule", "--disable-overlap-schedule"]])
def test_impossible_configs_are_refused(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        parse(argv)


def test_to_argv_round_trips() -> None:
    args = parse(["--tp", "2", "--enable-metrics", "--model-path", "/m", "--watchdog-timeout", "5"])
    assert parse(to_argv(args)) == args


def test_plan_single_node() -> None:
    plan = build_plan(parse(["--tp", "2"]), "/run/x", python="py")
    assert [c.name for c in plan.components] == ["api", "detokenizer", "scheduler_TP0",
                                                 "scheduler_TP1"]
    sched = plan.components[3]
    assert sched.title == "shoal::scheduler_TP1"
    assert sched.argv[:5] == ("py", "-m", "shoal", "component", "scheduler")
    assert "--tp-rank" in sched.argv and sched.argv[sched.argv.index("--tp-rank") + 1] == "1"


def test_plan_pipeline_and_second_node() -> None:
    args = parse(["--tp", "2", "--pp", "2", "--nnodes", "2", "--node-rank", "1",
                  "--dist-init-addr", "leader:5000"])
    names = [c.name for c in build_plan(args, "/run/x").components]
    assert names == ["scheduler_PP1_TP0", "scheduler_PP1_TP1"]


def test_plan_keeps_the_api_key_out_of_command_lines() -> None:
    plan = build_plan(parse(["--api-key", "sk-secret"]), "/run/x")
    for spec in plan.components:
        assert "sk-secret" not in " ".join(spec.argv)
        assert spec.env["SHOAL_API_KEY"] == "sk-secret"
