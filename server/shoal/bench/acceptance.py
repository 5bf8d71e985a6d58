"""The acceptance ratios of a `make bench` run (issue 12's, and the earlier ones the suite keeps
checking), as pure functions of the collected results.

A ratio of two systems measured in rounds (`SuiteConfig.rounds`) is the median of the rounds'
ratios, each of two runs seconds apart; against a system measured once, the ratio of the median
run to that run.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from shoal.bench.suite_runs import (
    LLAMA_F32,
    LLAMA_Q8,
    SHOAL,
    SHOAL_INT8,
    TRANSFORMERS,
    Run,
    Shape,
    SuiteConfig,
    SuiteResults,
    median_run,
    output_throughput,
)

VS_LLAMA_SINGLE = 1.0          # shoal / llama.cpp F32 at concurrency 1
VS_LLAMA_MANY = 1.5            # ... at concurrency 16, 32, 64
LLAMA_MANY = (16, 32, 64)
INT8_VS_FLOAT_SINGLE = 1.8     # shoal w8a16 / shoal float32 at concurrency 1
INT8_VS_Q8 = 1.0               # shoal w8a16 / llama.cpp Q8_0 at the int8 concurrencies
VS_TRANSFORMERS = 2.0          # at the ratio concurrency, every shape
VS_CEILING = 0.8
SINGLE_STREAM = 1.3            # shoal at concurrency 1 / transformers generate at batch 1
RADIX_TTFT = 4.0               # mean TTFT without / with the radix cache ...
RADIX_SHAPES = 2               # ... on more than one prefix/suffix shape
# speculative decoding at one stream, greedy: ngram / none output tok/s, per dataset
SPECULATION_TARGETS = {"repeat": 1.8, "random": 0.95}


def out_tps(run: Run | None) -> float | None:
    return None if run is None else output_throughput(run)


def ttft_ms(run: Run | None) -> float | None:
    r = None if run is None else run.result
    return None if r is None else float(r["ttft_ms"]["mean"])


def run_fwd_tps(run: Run | None) -> float | None:
    r = None if run is None else run.result
    return None if r is None else float(r["tokens_per_s"])


def fwd_tps(runs: list[Run] | None) -> float | None:
    """The ceiling: the median tokens/s of the bare-forward runs at one batch size."""
    values = [v for v in map(run_fwd_tps, runs or []) if v is not None]
    return statistics.median(values) if values else None


Value = Callable[[Run], float | None]


def round_ratios(a: list[Run], b: list[Run], value_a: Value, value_b: Value | None = None
                 ) -> list[float]:
    """value_a(a[i]) / value_b(b[i]) for each round i both ran cleanly; where the two were not
    measured the same number of times, the one ratio of their median runs."""
    value_b = value_b or value_a
    if len(a) != len(b):
        a = [r for r in (median_run(a, value_a),) if r is not None]
        b = [r for r in (median_run(b, value_b),) if r is not None]
    pairs = ((value_a(x), value_b(y)) for x, y in zip(a, b))
    return [x / y for x, y in pairs if x is not None and y is not None and y != 0]


def median_ratio(ratios: list[float]) -> float | None:
    return statistics.median(ratios) if ratios else None


def rounds_note(ratios: list[float]) -> str:
    return "" if len(ratios) < 2 else f"; rounds {' '.join(f'{r:.2f}' for r in ratios)}"


def generate_tps(run: Run | None) -> float | None:
    return None if run is None or not run.ok or not run.data else float(run.data["tokens_per_s"])


def best_generate_rounds(res: SuiteResults) -> list[Run]:
    """Round by round, the faster of transformers `generate`'s thread counts (a failed run where
    every thread count failed)."""
    rounds = max(map(len, res.generate.values()), default=0)
    best = []
    for i in range(rounds):
        runs = [r[i] for r in res.generate.values() if i < len(r)]
        best.append(max(runs, key=lambda r: generate_tps(r) or 0.0))
    return best


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


@dataclass(frozen=True)
class Criterion:
    """A ratio and its target; a `counted` one is not a criterion of its own but one of those a
    later criterion counts (each shared-prefix shape, of the shapes with a 4x TTFT)."""
    name: str
    measured: str
    ratio: float | None
    target: float
    counted: bool = False

    @property
    def reached(self) -> bool:
        return self.ratio is not None and self.ratio >= self.target

    @property
    def verdict(self) -> str:
        if self.ratio is None:
            return "n/a"
        if self.counted:
            return "counts" if self.reached else "not counted"
        return "PASS" if self.reached else "FAIL"


def throughput_rounds(res: SuiteResults, a: str, b: str, concurrency: int, shape: Shape
                      ) -> list[float]:
    """System a's output throughput over b's, round by round (`round_ratios`)."""
    return round_ratios(res.rounds(a, concurrency, shape), res.rounds(b, concurrency, shape),
                        out_tps)


def ceiling_rounds(res: SuiteResults, concurrency: int, shape: Shape) -> list[float]:
    """shoal's output throughput over the bare forward's run right after it, round by round."""
    return round_ratios(res.rounds(SHOAL, concurrency, shape), res.forward.get(concurrency, []),
                        out_tps, run_fwd_tps)


def _throughput(name: str, res: SuiteResults, a: str, b: str, concurrency: int, shape: Shape,
                target: float) -> Criterion:
    x, y = (out_tps(res.get(system, concurrency, shape)) for system in (a, b))
    ratios = throughput_rounds(res, a, b, concurrency, shape)
    return Criterion(name, f"{fmt(x)} / {fmt(y)} tok/s{rounds_note(ratios)}",
                     median_ratio(ratios), target)


def acceptance(cfg: SuiteConfig, res: SuiteResults) -> list[Criterion]:
    """Criteria whose runs the configuration has; n/a where a run failed."""
    c, shape = cfg.ratio_concurrency, cfg.shape
    crit: list[Criterion] = []
    if not cfg.skip_llama_cpp:
        for n in sorted({1, *LLAMA_MANY} & set(cfg.concurrencies)):
            crit.append(_throughput(
                f"1. same weights, concurrency {n}: shoal float32 / llama.cpp F32 output tok/s",
                res, SHOAL, LLAMA_F32, n, shape, VS_LLAMA_SINGLE if n == 1 else VS_LLAMA_MANY))
        ours, theirs = res.rounds(SHOAL, c, shape), res.rounds(LLAMA_F32, c, shape)
        ratios = round_ratios(theirs, ours, ttft_ms)
        crit.append(Criterion(
            f"1. TTFT at concurrency {c}: llama.cpp F32 / shoal float32 (mean)",
            f"{fmt(ttft_ms(median_run(theirs)), 0)} / {fmt(ttft_ms(median_run(ours)), 0)} ms"
            f"{rounds_note(ratios)}", median_ratio(ratios), 1.0))
    if 1 in cfg.int8_concurrencies:
        crit.append(_throughput("2. concurrency 1: shoal w8a16 / shoal float32", res,
                                SHOAL_INT8, SHOAL, 1, shape, INT8_VS_FLOAT_SINGLE))
    if not cfg.skip_llama_cpp:
        for n in cfg.int8_concurrencies:
            crit.append(_throughput(f"2. concurrency {n}: shoal w8a16 / llama.cpp Q8_0", res,
                                    SHOAL_INT8, LLAMA_Q8, n, shape, INT8_VS_Q8))
    if not cfg.skip_transformers:
        for s in cfg.shapes:
            crit.append(_throughput(
                f"4. {s[0]} in / {s[1]} out, concurrency {c}: shoal / transformers serve CB",
                res, SHOAL, TRANSFORMERS, c, s, VS_TRANSFORMERS))
    ratios = ceiling_rounds(res, c, shape)
    crit.append(Criterion(f"4. shoal at concurrency {c} / the bare forward of its workload",
                          f"{fmt(out_tps(res.get(SHOAL, c, shape)))} / "
                          f"{fmt(fwd_tps(res.forward.get(c)))} tok/s{rounds_note(ratios)}",
                          median_ratio(ratios), VS_CEILING))
    shared = []
    counted = len(cfg.shared_shapes) >= RADIX_SHAPES
    for s in cfg.shared_shapes:
        on, off = ttft_ms(res.shared.get((True, s))), ttft_ms(res.shared.get((False, s)))
        shared.append(Criterion(f"4. shared prefix {s[0]} + suffix {s[1]}: mean TTFT without / "
                                f"with the radix cache", f"{fmt(off, 0)} / {fmt(on, 0)} ms",
                                ratio(off, on), RADIX_TTFT, counted))
    crit += shared
    if counted:
        passed = [c for c in shared if c.reached]
        crit.append(Criterion(
            f"4. shared-prefix shapes with a {RADIX_TTFT:g}x TTFT from the radix cache",
            f"{len(passed)} of {len(shared)}", float(len(passed)), RADIX_SHAPES))
    if 1 in cfg.concurrencies:
        gens = best_generate_rounds(res)
        ratios = round_ratios(res.rounds(SHOAL, 1, shape), gens, out_tps, generate_tps)
        crit.append(Criterion(
            "single stream: shoal at concurrency 1 / transformers generate at batch 1",
            f"{fmt(out_tps(res.get(SHOAL, 1, shape)), 2)} / "
            f"{fmt(generate_tps(median_run(gens, generate_tps)), 2)} tok/s{rounds_note(ratios)}",
            median_ratio(ratios), SINGLE_STREAM))
    for dataset, target in SPECULATION_TARGETS.items():
        with_, without = res.speculation.get((dataset, True)), res.speculation.get((dataset, False))
        if with_ is None or without is None:
            continue
        ratios = round_ratios(with_, without, out_tps)
        crit.append(Criterion(
            f"speculative decoding, {dataset} dataset, one stream: ngram / none output tok/s",
            f"{fmt(out_tps(median_run(with_)))} / {fmt(out_tps(median_run(without)))} tok/s"
            f"{rounds_note(ratios)}", median_ratio(ratios), target))
    serving = res.serving_runs()
    clean = sum(r.ok for r in serving)
    crit.append(Criterion("`shoal bench serving` ran unmodified against every server, no "
                          "failed request", f"{clean} of {len(serving)} runs clean",
                          float(bool(serving) and clean == len(serving)), 1.0))
    return crit
