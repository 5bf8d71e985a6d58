"""The `make bench` report: acceptance ratios and docs/benchmarks.md from known results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shoal.bench.report import KEEP_SECTION, acceptance, plot_throughput, write_report
from shoal.bench.suite import _parser, config_from_args
from shoal.bench.suite_runs import QUICK, Run, SuiteConfig, SuiteResults

CFG = SuiteConfig(concurrencies=(1, 32))


def serving(output_tps: float, ttft_ms: float = 100.0, tpot_ms: float = 50.0) -> dict[str, Any]:
    stats = {"mean": ttft_ms, "p50": ttft_ms, "p90": ttft_ms, "p99": ttft_ms}
    lat = {"mean": tpot_ms, "p50": tpot_ms, "p90": tpot_ms, "p99": tpot_ms}
    return {"config": {}, "result": {
        "output_throughput": output_tps, "input_throughput": 10.0, "duration_s": 5.0,
        "ttft_ms": stats, "itl_ms": lat, "tpot_ms": lat, "e2e_latency_ms": stats}}


def run(label: str, data: dict[str, Any] | None, code: int = 0) -> Run:
    return Run(label, ["python", "-m", "shoal", "bench", label], Path("/nonexistent"),
               returncode=code, data=data)


def results(shoal32: float = 60.0, hf32: float = 25.0, fwd32: float = 70.0,
            shoal1: float = 20.0, gen: float = 14.0, ttft_on: float = 200.0,
            ttft_off: float = 1000.0) -> SuiteResults:
    res = SuiteResults()
    res.shoal = {1: run("shoal-c1", serving(shoal1)), 32: run("shoal-c32", serving(shoal32))}
    res.transformers = {1: run("hf-c1", serving(10.0)), 32: run("hf-c32", serving(hf32))}
    res.forward = {1: [run("fwd-b1", {"result": {"tokens_per_s": 22.0}})],
                   32: [run("fwd-b32-before", {"result": {"tokens_per_s": fwd32 - 5}}),
                        run("fwd-b32-after", {"result": {"tokens_per_s": fwd32 + 5}})]}
    res.generate = [run("gen-t1", {"tokens_per_s": gen, "decode_tokens_per_s": gen + 1,
                                   "num_threads": 1}),
                    run("gen-t2", {"tokens_per_s": gen / 2, "decode_tokens_per_s": gen,
                                   "num_threads": 2})]
    res.radix = run("radix", serving(5.0, ttft_ms=ttft_on))
    res.no_radix = run("no-radix", serving(5.0, ttft_ms=ttft_off))
    res.servers = {"shoal": "shoal serve --port 1"}
    return res


def test_acceptance_ratios_and_verdicts() -> None:
    crit = acceptance(CFG, results())
    assert [c.ratio for c in crit] == pytest.approx([60 / 25, 60 / 70, 20 / 14, 5.0, 1.0])
    assert [c.verdict for c in crit] == ["PASS", "PASS", "PASS", "PASS", "PASS"]

    crit = acceptance(CFG, results(hf32=40.0, fwd32=100.0, gen=16.0, ttft_off=700.0))
    assert [c.verdict for c in crit[:4]] == ["FAIL", "FAIL", "FAIL", "FAIL"]


def test_generate_baseline_is_the_best_thread_count() -> None:
    res = results(gen=14.0)
    assert acceptance(CFG, res)[2].ratio == pytest.approx(20 / 14)  # t1 (14) beats t2 (7)


def test_failed_run_makes_criteria_unavailable_and_criterion_5_fail() -> None:
    res = results()
    res.transformers[32] = run("hf-c32", None, code=1)
    crit = acceptance(CFG, res)
    assert crit[0].ratio is None and crit[0].verdict == "n/a"
    assert crit[4].verdict == "FAIL"


def test_report_has_tables_commands_and_keeps_the_hand_written_section(tmp_path: Path) -> None:
    md = tmp_path / "benchmarks.md"
    md.write_text(f"# old\n\n{KEEP_SECTION}\n\nDecode is bound by attention gathers.\n")
    machine = {"cpu": "Test CPU", "cores": "2", "memory": "24.0 GiB"}
    write_report(CFG, results(), machine, 600.0, md, tmp_path / "plot.png")
    text = md.read_text()
    assert "| cpu | Test CPU |" in text
    assert "| 32 | 60.0 | 25.0 | 70.0 | 2.40x | 0.86 |" in text
    assert "**PASS**" in text and "**FAIL**" not in text
    assert "shoal serve --port 1" in text and "shoal bench shoal-c32" in text
    assert text.count(KEEP_SECTION) == 1
    assert text.rstrip().endswith("Decode is bound by attention gathers.")
    assert "# old" not in text


def test_plot_is_written(tmp_path: Path) -> None:
    png = tmp_path / "plot.png"
    plot_throughput(CFG, results(), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_and_override_flags() -> None:
    cfg = config_from_args(_parser().parse_args(["--quick"]))
    assert cfg.quick and cfg.concurrencies == QUICK["concurrencies"]
    assert cfg.ratio_concurrency == 32
    cfg = config_from_args(_parser().parse_args(["--concurrencies", "1,8", "--output-len", "9"]))
    assert cfg.concurrencies == (1, 8) and cfg.output_len == 9 and not cfg.quick
    assert cfg.ratio_concurrency == 8  # 32 not run: the ratios use the highest concurrency
    assert SuiteConfig().num_prompts(1) == 4 and SuiteConfig().num_prompts(64) == 64
