"""The `make bench` suite: its workloads, acceptance ratios and docs/benchmarks.md from known
results."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from shoal.bench import suite
from shoal.bench.acceptance import acceptance
from shoal.bench.report import KEEP_SECTION, PERF_LOG, plot_throughput, write_report
from shoal.bench.servers import Server
from shoal.bench.suite import _parser, config_from_args, random_args
from shoal.bench.suite_runs import (
    LLAMA_F32,
    LLAMA_Q8,
    QUICK,
    SHOAL,
    SHOAL_INT8,
    TRANSFORMERS,
    Run,
    SuiteConfig,
    SuiteResults,
)
from shoal.ports import free_port

CFG = SuiteConfig(concurrencies=(1, 32), extra_shapes=((150, 64),), int8_concurrencies=(1, 32),
                  shared_shapes=((1024, 32), (512, 64)))
MAIN, OTHER = (64, 128), (150, 64)


# speculative decoding's runs at one stream: (dataset, ngram?) -> output tok/s
SPEC_TPS = {("repeat", False): 60.0, ("repeat", True): 120.0, ("random", False): 60.0,
            ("random", True): 62.0}


def serving(output_tps: float, ttft_ms: float = 100.0, tpot_ms: float = 50.0) -> dict[str, Any]:
    stats = {"mean": ttft_ms, "p50": ttft_ms, "p90": ttft_ms, "p99": ttft_ms}
    lat = {"mean": tpot_ms, "p50": tpot_ms, "p90": tpot_ms, "p99": tpot_ms}
    return {"config": {}, "result": {
        "output_throughput": output_tps, "input_throughput": 10.0, "duration_s": 5.0,
        "ttft_ms": stats, "itl_ms": lat, "tpot_ms": lat, "e2e_latency_ms": stats}}


def run(label: str, data: dict[str, Any] | None, code: int = 0) -> Run:
    return Run(label, ["python", "-m", "shoal", "bench", label], Path("/nonexistent"),
               returncode=code, data=data)


def generated(tps: float) -> dict[str, Any]:
    return {"tokens_per_s": tps, "decode_tokens_per_s": tps + 1}


def results(tps: dict[tuple[str, tuple[int, int], int], float] | None = None,
            ttft32: dict[str, float] | None = None, gen: float = 14.0,
            radix_ttft: tuple[float, float] = (200.0, 1000.0),
            spec: dict[tuple[str, bool], float] | None = None) -> SuiteResults:
    """Every run of CFG, with throughputs that pass every criterion unless overridden."""
    values = {(SHOAL, MAIN, 1): 40.0, (SHOAL, MAIN, 32): 300.0, (SHOAL, OTHER, 32): 200.0,
              (SHOAL_INT8, MAIN, 1): 80.0, (SHOAL_INT8, MAIN, 32): 400.0,
              (LLAMA_F32, MAIN, 1): 35.0, (LLAMA_F32, MAIN, 32): 180.0,
              (LLAMA_F32, OTHER, 32): 150.0, (LLAMA_Q8, MAIN, 1): 60.0,
              (LLAMA_Q8, MAIN, 32): 250.0, (TRANSFORMERS, MAIN, 1): 10.0,
              (TRANSFORMERS, MAIN, 32): 100.0, (TRANSFORMERS, OTHER, 32): 90.0,
              **(tps or {})}
    ttft = {SHOAL: 1000.0, LLAMA_F32: 1100.0, **(ttft32 or {})}
    res = SuiteResults()
    for (system, shape, c), v in values.items():
        ms = ttft.get(system, 500.0) if c == 32 and shape == MAIN else 100.0
        res.serving[(system, shape, c)] = [run(
            f"{system.replace(' ', '-')}-{shape[0]}x{shape[1]}-c{c}", serving(v, ttft_ms=ms))]
    res.forward = {1: [run("fwd-b1", {"result": {"tokens_per_s": 45.0}})],
                   32: [run("fwd-b32", {"result": {"tokens_per_s": 330.0}})]}
    res.generate = {1: [run("gen-t1", generated(gen))], 2: [run("gen-t2", generated(gen / 2))]}
    on, off = radix_ttft
    for shape in CFG.shared_shapes:
        res.shared[(True, shape)] = run(f"radix-{shape}", serving(5.0, ttft_ms=on))
        res.shared[(False, shape)] = run(f"no-radix-{shape}", serving(5.0, ttft_ms=off))
    for (dataset, speculating), v in (spec or SPEC_TPS).items():
        res.speculation[(dataset, speculating)] = [run(
            f"speculation-{dataset}-{'ngram' if speculating else 'none'}", serving(v))]
    res.accept_lengths = {"repeat": [3.25], "random": [1.5]}
    res.servers = {SHOAL: "shoal serve --port 1"}
    return res


def by_name(cfg: SuiteConfig, res: SuiteResults) -> dict[str, tuple[float | None, str]]:
    return {c.name: (c.ratio, c.verdict) for c in acceptance(cfg, res)}


def test_every_issue_criterion_is_checked_and_passes_on_good_numbers() -> None:
    crit = by_name(CFG, results())
    assert all(verdict in ("PASS", "counts") for _, verdict in crit.values()), crit
    ratios = [r for r, _ in crit.values()]
    assert ratios[:5] == pytest.approx([40 / 35, 300 / 180, 1100 / 1000, 80 / 40, 80 / 60])
    assert len(crit) == 16  # 1: c1, c32, TTFT; 2: int8/f32, int8/Q8 x2; 4: 2 shapes vs
    # transformers, ceiling, 2 shared-prefix shapes and how many pass; single stream;
    # speculation on 2 datasets; clean runs


def test_speculation_must_gain_on_repeated_text_and_never_lose_much_on_random() -> None:
    name = "speculative decoding, {} dataset, one stream: ngram / none output tok/s"
    crit = by_name(CFG, results())
    assert crit[name.format("repeat")] == (pytest.approx(2.0), "PASS")
    crit = by_name(CFG, results(spec={("repeat", False): 60.0, ("repeat", True): 105.0,
                                      ("random", False): 60.0, ("random", True): 56.0}))
    assert crit[name.format("repeat")][1] == "FAIL"  # 1.75 < 1.8
    assert crit[name.format("random")][1] == "FAIL"  # 0.93 < 0.95


def test_targets_fail_where_the_issue_draws_the_line() -> None:
    crit = by_name(CFG, results(
        tps={(SHOAL, MAIN, 32): 260.0, (SHOAL_INT8, MAIN, 1): 70.0,
             (TRANSFORMERS, OTHER, 32): 101.0},
        ttft32={LLAMA_F32: 900.0}, radix_ttft=(300.0, 1000.0)))
    failed = {name for name, (_, verdict) in crit.items() if verdict == "FAIL"}
    assert failed == {
        "1. same weights, concurrency 32: shoal float32 / llama.cpp F32 output tok/s",  # 1.44
        "1. TTFT at concurrency 32: llama.cpp F32 / shoal float32 (mean)",
        "2. concurrency 1: shoal w8a16 / shoal float32",  # 1.75
        "4. 150 in / 64 out, concurrency 32: shoal / transformers serve CB",  # 1.98
        "4. shoal at concurrency 32 / the bare forward of its workload",  # 260 / 330 = 0.79
        "4. shared-prefix shapes with a 4x TTFT from the radix cache"}  # 0 of 2 (3.33x)


def test_the_radix_cache_must_give_its_4x_on_more_than_one_shape() -> None:
    """Each shape's ratio is listed, counted or not; the criterion is how many reach 4x (with one
    shape, that shape's ratio is the criterion)."""
    shapes = ((2048, 32), (1024, 32), (512, 64))
    cfg = dataclasses.replace(CFG, shared_shapes=shapes)
    summary = "4. shared-prefix shapes with a 4x TTFT from the radix cache"
    for off_ms, passing in (((15000.0, 8000.0, 3000.0), 2), ((15000.0, 3900.0, 3000.0), 1)):
        res = results()
        for shape, off in zip(shapes, off_ms, strict=True):
            res.shared[(True, shape)] = run(f"radix-{shape}", serving(5.0, ttft_ms=1000.0))
            res.shared[(False, shape)] = run(f"no-radix-{shape}", serving(5.0, ttft_ms=off))
        crit = by_name(cfg, res)
        assert crit["4. shared prefix 512 + suffix 64: mean TTFT without / with the radix "
                    "cache"] == (3.0, "not counted")
        assert crit["4. shared prefix 2048 + suffix 32: mean TTFT without / with the radix "
                    "cache"] == (15.0, "counts")
        assert crit[summary] == (float(passing), "PASS" if passing >= 2 else "FAIL")
    one = dataclasses.replace(CFG, shared_shapes=((512, 64),))
    crit = by_name(one, results(radix_ttft=(300.0, 1000.0)))
    assert crit["4. shared prefix 512 + suffix 64: mean TTFT without / with the radix "
                "cache"] == (pytest.approx(1000 / 300), "FAIL")
    assert summary not in crit


def test_a_failed_run_makes_its_criterion_unavailable_and_the_clean_check_fail() -> None:
    res = results()
    res.serving[(LLAMA_Q8, MAIN, 32)] = [run("q8-c32", None, code=1)]
    crit = by_name(CFG, res)
    assert crit["2. concurrency 32: shoal w8a16 / llama.cpp Q8_0"] == (None, "n/a")
    name = "`shoal bench serving` ran unmodified against every server, no failed request"
    assert crit[name] == (0.0, "FAIL")


def test_rounds_compare_runs_seconds_apart_and_tables_show_the_median_round(
        tmp_path: Path) -> None:
    """The host drifts between rounds: each round's ratio pairs the runs measured together, and
    the criterion is their median, not the ratio of each side's median."""
    res = results()
    res.serving[(SHOAL, MAIN, 1)] = [run(f"shoal-r{i}", serving(v, ttft_ms=100.0 + i))
                                     for i, v in enumerate((30.0, 40.0, 50.0))]
    res.serving[(LLAMA_F32, MAIN, 1)] = [run(f"llama-r{i}", serving(v))
                                         for i, v in enumerate((33.0, 38.0, 60.0))]
    res.serving[(SHOAL_INT8, MAIN, 1)] = [run("int8-r0", serving(80.0)),
                                          run("int8-r1", None, code=1),
                                          run("int8-r2", serving(90.0))]
    res.forward[32] = [run(f"fwd-r{i}", {"result": {"tokens_per_s": v}})
                       for i, v in enumerate((300.0, 400.0, 500.0))]
    res.serving[(SHOAL, MAIN, 32)] = [run(f"s32-r{i}", serving(v))
                                      for i, v in enumerate((270.0, 280.0, 390.0))]
    crit = {c.name: c for c in acceptance(CFG, res)}
    vs_llama = crit["1. same weights, concurrency 1: shoal float32 / llama.cpp F32 output tok/s"]
    assert vs_llama.ratio == pytest.approx(30 / 33)  # rounds 0.91, 1.05, 0.83; medians 40 / 38
    assert vs_llama.measured == "40.0 / 38.0 tok/s; rounds 0.91 1.05 0.83"
    # the failed int8 round drops out of its pairs (80 / 30, 90 / 50), not the others
    int8 = crit["2. concurrency 1: shoal w8a16 / shoal float32"]
    assert int8.ratio == pytest.approx((80 / 30 + 90 / 50) / 2)
    ceiling = crit["4. shoal at concurrency 32 / the bare forward of its workload"]
    assert ceiling.ratio == pytest.approx(0.78) and ceiling.verdict == "FAIL"  # .9 .7 .78
    # transformers ran once: shoal's median round against it
    assert crit["4. 64 in / 128 out, concurrency 32: shoal / transformers serve CB"].ratio \
        == pytest.approx(280 / 100)
    md = tmp_path / "benchmarks.md"
    write_report(CFG, res, {"cpu": "x"}, 60.0, md, tmp_path / "plot.png")
    text = md.read_text()
    assert "| shoal | 64 / 128 | 1 | 101.0 |" in text  # the latencies of the median round
    assert "| 1 | 40.0 | 80.0 | 38.0 | 60.0 | 10.0 | 45.0 | 0.91 |" in text
    assert "| 32 | 280.0 | 400.0 | 180.0 | 250.0 | 100.0 | 400.0 | 1.56 | 1.60 | 2.80 | 0.78 |" \
        in text


def test_skipped_peers_drop_their_criteria() -> None:
    cfg = SuiteConfig(concurrencies=(1, 32), skip_llama_cpp=True, skip_transformers=True,
                      extra_shapes=((150, 64),), int8_concurrencies=(1, 32),
                      shared_shapes=CFG.shared_shapes)
    names = list(by_name(cfg, results()))
    assert not any("llama.cpp" in n or "transformers serve" in n for n in names)
    assert "2. concurrency 1: shoal w8a16 / shoal float32" in names


def test_generate_baseline_is_the_best_thread_count() -> None:
    crit = by_name(CFG, results(gen=14.0))
    assert crit["single stream: shoal at concurrency 1 / transformers generate at batch 1"][0] \
        == pytest.approx(40 / 14)  # t1 (14) beats t2 (7)


def test_generate_runs_in_rounds_paired_with_shoals_single_stream(tmp_path: Path) -> None:
    """Each round's shoal run over that round's faster thread count; a round where generate
    failed on every thread count drops out."""
    res = results()
    res.serving[(SHOAL, MAIN, 1)] = [run(f"shoal-r{i}", serving(v))
                                     for i, v in enumerate((30.0, 40.0, 50.0, 60.0))]
    res.generate = {
        1: [run("g1-r0", generated(20.0)), run("g1-r1", generated(25.0)),
            run("g1-r2", None, code=1), run("g1-r3", None, code=1)],
        2: [run("g2-r0", generated(24.0)), run("g2-r1", generated(20.0)),
            run("g2-r2", generated(40.0)), run("g2-r3", None, code=1)]}
    crit = {c.name: c for c in acceptance(CFG, res)}
    single = crit["single stream: shoal at concurrency 1 / transformers generate at batch 1"]
    assert single.ratio == pytest.approx(1.25)  # rounds 30/24, 40/25, 50/40
    assert single.measured == "40.00 / 25.00 tok/s; rounds 1.25 1.60 1.25"
    assert single.verdict == "FAIL"
    md = tmp_path / "benchmarks.md"
    write_report(CFG, res, {"cpu": "x"}, 60.0, md, tmp_path / "plot.png")
    text = md.read_text()
    assert "| transformers generate, batch 1, 1 threads | 20.00 | 21.00 |" in text
    assert "| transformers generate, batch 1, 2 threads | 24.00 | 25.00 |" in text


def test_workloads_seeds_and_shapes() -> None:
    cfg = SuiteConfig()
    assert cfg.workloads((1, 32)) == [((64, 128), 1), ((64, 128), 32), ((150, 64), 32),
                                      ((512, 32), 32)]
    assert cfg.workloads((1, 16)) == [((64, 128), 1), ((64, 128), 16)]
    seeds = {cfg.seed_for(s, c, r) for s, c in cfg.workloads(cfg.concurrencies)
             for r in range(cfg.rounds)}
    # no two runs share prompts, rounds included
    assert len(seeds) == len(cfg.workloads(cfg.concurrencies)) * cfg.rounds
    args = random_args(cfg, (512, 32), 32)
    assert args[args.index("--input-len") + 1] == "512"
    assert args[args.index("--max-concurrency") + 1] == "32"
    assert SuiteConfig().num_prompts(1) == 4 and SuiteConfig().num_prompts(64) == 64


def test_llama_cpp_runs_one_thread_per_core_and_tries_one_fewer() -> None:
    assert SuiteConfig().llama_threads(2) == 2 and SuiteConfig().llama_thread_trials(2) == [1]
    assert SuiteConfig().llama_threads(16) == 16 and SuiteConfig().llama_thread_trials(16) == [15]
    assert SuiteConfig().llama_thread_trials(1) == []
    assert SuiteConfig(llama_cpp_threads=1).llama_thread_trials(2) == []
    assert SuiteConfig(llama_cpp_thread_trials=(2, 4)).llama_thread_trials(2) == [4]


def test_kv_pool_holds_twice_the_largest_workload() -> None:
    assert SuiteConfig().kv_tokens == 36864  # 2 x 32 x (512 + 32), in pages of 4096
    assert SuiteConfig(concurrencies=(64,), extra_shapes=()).kv_tokens == 2 * 64 * 192
    assert SuiteConfig(concurrencies=(128,), shared_shapes=((64, 8),)).kv_tokens == 2 * 128 * 192
    assert SuiteConfig().shared_kv_tokens == 73728  # 2 x (16 x (2048 + 32 + 16) + 2048)
    assert SuiteConfig(shared_shapes=((512, 64),)).shared_kv_tokens == 20480


def test_phases_measure_what_the_ratios_read_first() -> None:
    assert SuiteConfig().phase_order() == [1, 32, 16, 64, 4]
    assert SuiteConfig(**QUICK).phase_order() == [1, 32, 4]
    assert SuiteConfig(concurrencies=(2, 8), int8_concurrencies=(1,)).phase_order() == [1, 8, 2]


def test_report_has_every_table_and_keeps_the_sections_after_where_the_time_goes(
        tmp_path: Path) -> None:
    md = tmp_path / "benchmarks.md"
    md.write_text(f"# old\n\n| stale | table |\n\n{KEEP_SECTION}\n\nDecode is bound by gathers.\n"
                  f"\n## Router: cache_aware vs round_robin\n\n| policy | TTFT |\n")
    machine = {"cpu": "Test CPU", "cores": "2", "memory": "24.0 GiB"}
    res = results()
    res.notes = ["llama.cpp Q8_0: runs with --no-repack"]
    write_report(CFG, res, machine, 600.0, md, tmp_path / "plot.png")
    text = md.read_text()
    assert "## Notes\n\n- llama.cpp Q8_0: runs with --no-repack" in text
    assert "## Failures" not in text
    assert "| cpu | Test CPU |" in text
    # concurrency, shoal, w8a16, llama F32, Q8_0, transformers, bare forward, ratios
    assert "| 32 | 300.0 | 400.0 | 180.0 | 250.0 | 100.0 | 330.0 | 1.67 | 1.60 | 3.00 | 0.91 |" \
        in text
    assert "| 150 / 64 | 200.0 (100) | 150.0 (100) | 90.0 (100) | 1.33 | 2.22 |" in text
    assert "| 1024 + 32 | radix cache | 200.0 |" in text
    assert "| 512 + 64 | --disable-radix-cache | 1000.0 |" in text
    assert "| llama.cpp Q8_0 | 64 / 128 | 32 | 500.0 |" in text
    assert "| repeat | 60.0 | 120.0 | 3.25 | 2.00 |" in text
    assert "| random | 60.0 | 62.0 | 1.50 | 1.03 |" in text
    assert "**PASS**" in text and "**FAIL**" not in text
    assert "shoal serve --port 1" in text and "shoal bench llama.cpp-F32-64x128-c32" in text
    assert text.count(KEEP_SECTION) == 1 and "stale" not in text and "# old" not in text
    assert text.rstrip().endswith("Decode is bound by gathers.\n\n"
                                  "## Router: cache_aware vs round_robin\n\n| policy | TTFT |")


def test_a_first_report_points_at_the_performance_log_and_never_writes_it(
        tmp_path: Path) -> None:
    log = tmp_path / PERF_LOG
    log.write_text("# Performance log\n\n## Session 1\n")
    md = tmp_path / "benchmarks.md"
    write_report(CFG, results(), {"cpu": "Test CPU"}, 600.0, md, tmp_path / "plot.png")
    text = md.read_text()
    assert text.count(KEEP_SECTION) == 1 and f"]({PERF_LOG})" in text
    assert "Session 1" not in text and log.read_text() == "# Performance log\n\n## Session 1\n"


def test_llama_cpp_thread_trials_get_their_table(tmp_path: Path) -> None:
    res = results()
    res.llama_threads[(1, 1)] = run("llama-t1-c1", serving(20.0, tpot_ms=48.0))
    md = tmp_path / "benchmarks.md"
    write_report(CFG, res, {"cpu": "x"}, 60.0, md, tmp_path / "plot.png")
    text = md.read_text()
    assert "### llama.cpp thread counts" in text
    assert "| 1 | 1 | 20.0 | 48.0 |" in text


def test_plot_is_written(tmp_path: Path) -> None:
    png = tmp_path / "plot.png"
    plot_throughput(CFG, results(), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_and_override_flags() -> None:
    cfg = config_from_args(_parser().parse_args(["--quick"]))
    assert cfg.quick and cfg.concurrencies == QUICK["concurrencies"]
    assert cfg.ratio_concurrency == 32
    cfg = config_from_args(_parser().parse_args(
        ["--concurrencies", "1,8", "--output-len", "9", "--skip-llama-cpp",
         "--llama-cpp-threads", "1"]))
    assert cfg.concurrencies == (1, 8) and cfg.output_len == 9 and not cfg.quick
    assert cfg.skip_llama_cpp and cfg.llama_cpp_threads == 1
    assert cfg.ratio_concurrency == 8  # 32 not run: the ratios use the highest concurrency
    assert cfg.rounds == 3 and config_from_args(_parser().parse_args(["--rounds", "5"])).rounds == 5
    with pytest.raises(SystemExit):
        _parser().parse_args(["--rounds", "0"])


class FakeServer(Server):
    started: list[str] = []
    dies: set[str] = set()  # names that are found dead once after starting

    def start(self) -> FakeServer:
        FakeServer.started.append(self.name)
        return self

    def alive(self) -> bool:
        if self.name in FakeServer.dies:
            FakeServer.dies.discard(self.name)
            return False
        return True

    def stop(self) -> None:
        pass


def test_the_run_measures_each_concurrency_on_every_server_back_to_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def fake_run(label: str, *rest: Any) -> Run:
        calls.append(label)
        return run(label, serving(1.0))

    def fake_server(name: str) -> FakeServer:
        return FakeServer(name, ["x"], {}, "http://127.0.0.1:1", tmp_path / "log")

    monkeypatch.setattr(suite, "serving_run", fake_run)
    monkeypatch.setattr(suite, "forward_run", fake_run)
    flags: dict[str, tuple[str, ...]] = {}
    monkeypatch.setattr(suite, "shoal_server", lambda _dir, name, *given: (
        flags.setdefault(name, given), fake_server(name))[1])
    monkeypatch.setattr(suite, "transformers_server", lambda name, *rest: fake_server(name))
    monkeypatch.setattr(suite, "llama_server", lambda name, *rest, **_: fake_server(name))
    monkeypatch.setattr(suite, "generate_run", fake_run)
    monkeypatch.setattr(suite.Suite, "llama_ggufs", lambda self: (Path("f32"), Path("q8")))
    monkeypatch.setattr(suite.httpx, "post", lambda *a, **k: type("R", (), {"status_code": 200}))
    monkeypatch.setattr(suite, "usable_cores", lambda: 2)  # the 2-core host's choices, anywhere
    FakeServer.started, FakeServer.dies = [], {SHOAL}
    cfg = SuiteConfig(concurrencies=(1, 4, 32), extra_shapes=((150, 64),),
                      int8_concurrencies=(1,), shared_shapes=((256, 16),), llama_cpp_threads=1,
                      llama_cpp_thread_trials=(2,), rounds=2)
    phases: list[int] = []
    res = suite.Suite(cfg, tmp_path, Path("bin"),
                      lambda r: phases.append(len(r.serving))).run()
    rounds = [f"-r{r}" for r in (1, 2)]
    generate = ["generate-t1", "generate-t2"]  # transformers' generate on 1 and 2 threads
    assert calls == [
        *(name + r for r in rounds for name in (
            "shoal-64x128-c1", "forward-b1", *generate, "llama-cpp-F32-64x128-c1",
            "shoal-w8a16-64x128-c1", "llama-cpp-Q8-0-64x128-c1")),
        "transformers-serve-CB-64x128-c1",
        *(name + r for r in rounds for name in (
            "shoal-64x128-c32", "forward-b32", "llama-cpp-F32-64x128-c32")),
        "shoal-150x64-c32", "llama-cpp-F32-150x64-c32",
        "transformers-serve-CB-64x128-c32", "transformers-serve-CB-150x64-c32",
        *(name + r for r in rounds for name in (
            "shoal-64x128-c4", "forward-b4", "llama-cpp-F32-64x128-c4")),
        "transformers-serve-CB-64x128-c4",
        "shoal-shared-prefix-256+16", "shoal-shared-prefix-256+16-no-radix",
        *(f"speculation-{dataset}-{kind}{r}" for r in rounds for dataset in ("repeat", "random")
          for kind in ("none", "ngram")),
        "llama-cpp-F32-64x128-c1-t2", "llama-cpp-F32-64x128-c32-t2"]
    # shoal w8a16 started once; a llama-server and a transformers serve per phase, a
    # llama-server per trial
    assert FakeServer.started.count(SHOAL_INT8) == 1
    assert [n for n in FakeServer.started if n.startswith(TRANSFORMERS)] == [
        f"{TRANSFORMERS} (concurrency {c})" for c in (1, 32, 4)]
    # shoal was found dead when the second phase asked for it: started again, the death recorded
    assert FakeServer.started.count(SHOAL) == 2
    assert len(res.errors) == 1 and res.errors[0].startswith(SHOAL + " exited with")
    assert "llama.cpp F32 -np 32 -t 1" in FakeServer.started
    assert len(res.serving) == 14 and len(res.llama_threads) == 2 and len(res.shared) == 2
    assert len(res.speculation) == 4 and all(len(r) == 2 for r in res.speculation.values())
    # after each concurrency, no-radix, the speculation rounds, the trials
    assert phases == [5, 11, 14, 14, 14, 14]
    # the shared-prefix servers come last, alone, with a KV pool sized for their shapes
    shared_kv = ("--max-total-tokens", str(cfg.shared_kv_tokens))
    assert flags["shoal shared prefix"] == shared_kv
    assert flags["shoal shared prefix --disable-radix-cache"] == (*shared_kv,
                                                                  "--disable-radix-cache")
    assert flags[SHOAL] == ("--max-total-tokens", str(cfg.kv_tokens))
    assert flags["shoal ngram"] == (*flags[SHOAL], "--speculative-algorithm", "ngram")
    assert flags["shoal no speculation"] == flags[SHOAL]


_LLAMA_STAND_IN = """
import http.server, os, signal, sys
if sys.argv[2] == "exit":
    sys.exit(1)
if "--no-repack" not in sys.argv:
    os.kill(os.getpid(), signal.SIGILL)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_llama_server_killed_by_an_illegal_instruction_runs_again_without_repacking(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's AMX Q8_0 kernel raised SIGILL while loading on a Xeon: that GGUF's servers
    run with --no-repack from then on, the change recorded; a server that exits otherwise is not
    started again."""
    def stand_in(name: str, _bin: Path, gguf: Path, *rest: Any, repack: bool = True) -> Server:
        port = free_port()
        how = "exit" if gguf == Path("f32") else "sigill"
        argv = [sys.executable, "-c", _LLAMA_STAND_IN, str(port), how,
                *([] if repack else ["--no-repack"])]
        return Server(name, argv, {}, f"http://127.0.0.1:{port}", tmp_path / f"{name}.log")

    monkeypatch.setattr(suite, "llama_server", stand_in)
    run_ = suite.Suite(SuiteConfig(), tmp_path, Path("bin"))
    with contextlib.ExitStack() as stack:
        q8 = run_.llama_phase_server(stack, LLAMA_Q8, Path("q8"), 1, [(MAIN, 1)])
        assert q8 is not None and q8.alive() and q8.argv[-1] == "--no-repack"
        assert run_.llama_phase_server(stack, LLAMA_Q8, Path("q8"), 1, [(MAIN, 1)]) is not None
        assert run_.llama_phase_server(stack, LLAMA_F32, Path("f32"), 1, [(MAIN, 1)]) is None
    assert run_.no_repack == {Path("q8")}
    # Q8_0's death is a note (every measurement still taken); F32's, not retried, a failure
    assert len(run_.res.notes) == 1 and "--no-repack from here on" in run_.res.notes[0]
    assert len(run_.res.errors) == 1 and run_.res.errors[0].startswith(LLAMA_F32)
    assert not q8.alive()
