"""The `make bench` report: docs/benchmarks.md (machine, workload, tables, the acceptance ratios,
exact commands) and the throughput plot, from a finished suite run."""

from __future__ import annotations

import datetime as dt
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from shoal.bench.suite_runs import Run, SuiteConfig, SuiteResults
from shoal.engine.threads import torch_threads_per_rank

KEEP_SECTION = "## Where the time goes"
ACCEPT_VS_TRANSFORMERS = 2.0
ACCEPT_VS_CEILING = 0.8
ACCEPT_SINGLE_STREAM = 1.3
ACCEPT_RADIX_TTFT = 4.0


def machine_info() -> dict[str, str]:
    import torch
    import transformers

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from shoal import __version__ as shoal_version

    return {"cpu": cpu, "cores": str(os.cpu_count()),
            "memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
            "os": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "shoal": shoal_version}


def _result(run: Run | None) -> dict[str, Any] | None:
    return run.data["result"] if run is not None and run.ok and run.data else None


def _out_tps(run: Run | None) -> float | None:
    r = _result(run)
    return None if r is None else float(r["output_throughput"])


def _fwd_tps(runs: list[Run] | None) -> float | None:
    """The ceiling: mean tokens/s of the bare-forward runs around a serving run."""
    values = [float(r["tokens_per_s"]) for r in map(_result, runs or []) if r is not None]
    return sum(values) / len(values) if values else None


def _best_generate(res: SuiteResults) -> dict[str, Any] | None:
    done = [r.data for r in res.generate if r.ok and r.data]
    return max(done, key=lambda d: d["tokens_per_s"]) if done else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _f(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


@dataclass(frozen=True)
class Criterion:
    name: str
    measured: str
    ratio: float | None
    target: float

    @property
    def verdict(self) -> str:
        if self.ratio is None:
            return "n/a"
        return "PASS" if self.ratio >= self.target else "FAIL"


def acceptance(cfg: SuiteConfig, res: SuiteResults) -> list[Criterion]:
    c = cfg.ratio_concurrency
    shoal_c = _out_tps(res.shoal.get(c))
    hf_c = _out_tps(res.transformers.get(c))
    fwd_c = _fwd_tps(res.forward.get(c))
    single = _out_tps(res.shoal.get(1))
    gen = _best_generate(res)
    gen_tps = None if gen is None else float(gen["tokens_per_s"])
    radix, no_radix = _result(res.radix), _result(res.no_radix)
    ttft_on = None if radix is None else radix["ttft_ms"]["mean"]
    ttft_off = None if no_radix is None else no_radix["ttft_ms"]["mean"]
    serving = [r for r in [*res.shoal.values(), *res.transformers.values(), res.radix,
                           res.no_radix] if r is not None]
    all_ok = bool(res.shoal) and bool(res.transformers) and all(r.ok for r in serving)
    clean = None if cfg.skip_transformers else float(all_ok)
    return [
        Criterion(f"1. output throughput at concurrency {c}: shoal / transformers serve CB",
                  f"{_f(shoal_c)} / {_f(hf_c)} tok/s", _ratio(shoal_c, hf_c),
                  ACCEPT_VS_TRANSFORMERS),
        Criterion(f"2. shoal at concurrency {c} / bare forward at batch {c}",
                  f"{_f(shoal_c)} / {_f(fwd_c)} tok/s", _ratio(shoal_c, fwd_c),
                  ACCEPT_VS_CEILING),
        Criterion("3. single stream: shoal at concurrency 1 / transformers generate at batch 1",
                  f"{_f(single, 2)} / {_f(gen_tps, 2)} tok/s", _ratio(single, gen_tps),
                  ACCEPT_SINGLE_STREAM),
        Criterion("4. shared prefix: mean TTFT without / with the radix cache",
                  f"{_f(ttft_off, 0)} / {_f(ttft_on, 0)} ms", _ratio(ttft_off, ttft_on),
                  ACCEPT_RADIX_TTFT),
        Criterion("5. `shoal bench serving` ran unmodified against both servers, no failed "
                  "request", f"{sum(r.ok for r in serving)} of {len(serving)} runs clean",
                  clean, 1.0),
    ]


def _threads_note(cfg: SuiteConfig) -> str:
    threads = torch_threads_per_rank(os.cpu_count() or 1, 1)
    hf_threads = cfg.transformers_threads or threads
    return (f"torch threads: shoal's scheduler and the bare forward use {threads} (one core "
            f"per rank, one left to the api/detokenizer); `transformers serve` runs with "
            f"OMP_NUM_THREADS={hf_threads} (on 2 cores its default of one thread per core ran "
            f"~5x slower next to its own HTTP thread and the benchmark client); `generate` is "
            f"the best of {{{', '.join(map(str, sorted({threads, os.cpu_count() or 1})))}}} "
            f"threads.")


def write_report(cfg: SuiteConfig, res: SuiteResults, machine: dict[str, str],
                 wall_s: float, md_path: Path, png_path: Path) -> list[Criterion]:
    criteria = acceptance(cfg, res)
    lines = [
        "# Benchmarks",
        "",
        f"Produced by `make bench` (`python -m shoal.bench.suite`) on "
        f"{dt.date.today().isoformat()} in {wall_s / 60:.1f} minutes"
        f"{' — QUICK MODE, not a result' if cfg.quick else ''}. Model: SmolLM2-135M-Instruct, "
        f"float32, CPU. Regenerate with `make bench`; `make bench BENCH_ARGS=--quick` is a "
        f"smoke run.",
        "",
        "## Machine",
        "",
        "| | |", "|---|---|",
        *[f"| {k} | {v} |" for k, v in machine.items()],
        "",
        _threads_note(cfg),
        "",
        "## Workload",
        "",
        f"- random dataset: {cfg.input_len} prompt tokens, {cfg.output_len} output tokens "
        f"(EOS ignored, greedy), at concurrency {', '.join(map(str, cfg.concurrencies))}; "
        f"num-prompts = max({cfg.min_prompts}, {cfg.waves} x concurrency), seed = "
        f"{cfg.seed} + concurrency (no run repeats another's prompts); all requests are sent "
        f"at once (request rate inf) and `--max-concurrency` keeps that many in flight.",
        f"- shared-prefix dataset: {cfg.shared_num_prompts} requests of one common "
        f"{cfg.prefix_len}-token prefix + a unique {cfg.suffix_len}-token suffix, "
        f"{cfg.shared_output_len} output tokens, concurrency {cfg.shared_concurrency}, with and "
        f"without `--disable-radix-cache`. The cache starts cold (`/flush_cache`, and the "
        f"warmup request shares no prefix with the dataset), so the first wave pays the "
        f"prefix in both runs.",
        f"- bare forward: `shoal bench forward` at batch = concurrency, KV context "
        f"{cfg.forward_context_len} tokens (the mean context of a random-dataset request while "
        f"it decodes: {cfg.input_len} + {cfg.output_len}/2), {cfg.forward_steps} timed steps; "
        f"the mean of a run right before and one right after shoal's serving run at that "
        f"concurrency (the server up and idle), since what this shared host gives drifts.",
        "- transformers `generate`: batch 1, the same prompt and output lengths; tokens/s = "
        "output tokens / generate time (prefill included, as in a serving request).",
        "",
        "## Output throughput (tokens/s), random dataset",
        "",
        f"![output throughput vs concurrency]({png_path.name})",
        "",
        "| concurrency | shoal | transformers serve CB | bare forward (batch = c) | "
        "shoal / transformers | shoal / bare forward |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cfg.concurrencies:
        s, h, f = _out_tps(res.shoal.get(c)), _out_tps(res.transformers.get(c)), \
            _fwd_tps(res.forward.get(c))
        lines.append(f"| {c} | {_f(s)} | {_f(h)} | {_f(f)} | {_f(_ratio(s, h), 2)}x | "
                     f"{_f(_ratio(s, f), 2)} |")
    lines += ["", "## Latency (ms), random dataset", "",
              "TTFT: request sent to the first streamed chunk with text; ITL: gaps between "
              "chunks with text, pooled; TPOT: (e2e - TTFT) / (output tokens - 1), tokens from "
              "the server's `usage`; e2e: request sent to stream closed.", "",
              "| server | concurrency | TTFT mean | TTFT p50 | TTFT p90 | TTFT p99 | ITL mean | "
              "ITL p99 | TPOT mean | TPOT p99 | e2e mean | e2e p99 |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, runs in (("shoal", res.shoal), ("transformers", res.transformers)):
        for c in cfg.concurrencies:
            r = _result(runs.get(c))
            if r is None:
                continue
            t, i, p, e = r["ttft_ms"], r["itl_ms"], r["tpot_ms"], r["e2e_latency_ms"]
            lines.append(f"| {name} | {c} | {_f(t['mean'])} | {_f(t['p50'])} | {_f(t['p90'])} | "
                         f"{_f(t['p99'])} | {_f(i['mean'])} | {_f(i['p99'])} | {_f(p['mean'])} | "
                         f"{_f(p['p99'])} | {_f(e['mean'])} | {_f(e['p99'])} |")
    lines += ["", "## Shared prefix", "",
              "| shoal | TTFT mean (ms) | TTFT p50 | TTFT p99 | input tok/s | output tok/s | "
              "duration (s) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, run in (("radix cache", res.radix), ("--disable-radix-cache", res.no_radix)):
        r = _result(run)
        if r is not None:
            t = r["ttft_ms"]
            lines.append(f"| {name} | {_f(t['mean'])} | {_f(t['p50'])} | {_f(t['p99'])} | "
                         f"{_f(r['input_throughput'])} | {_f(r['output_throughput'])} | "
                         f"{_f(r['duration_s'])} |")
    lines += ["", "## Single stream", "", "| | tokens/s | decode only (tokens/s) |",
              "|---|---:|---:|"]
    single = _result(res.shoal.get(1))
    if single is not None:
        tpot = single["tpot_ms"]["mean"]
        lines.append(f"| shoal, concurrency 1 | {_f(single['output_throughput'], 2)} | "
                     f"{_f(None if not tpot else 1000 / tpot, 2)} (1000 / TPOT) |")
    for r in res.generate:
        if r.ok and r.data:
            lines.append(f"| transformers generate, batch 1, {r.data['num_threads']} threads | "
                         f"{_f(r.data['tokens_per_s'], 2)} | "
                         f"{_f(r.data['decode_tokens_per_s'], 2)} |")
    lines += ["", "## Acceptance", "", "| criterion | measured | ratio | target | |",
              "|---|---|---:|---:|---|"]
    for crit in criteria:
        ratio = "n/a" if crit.ratio is None else f"{crit.ratio:.2f}"
        lines.append(f"| {crit.name} | {crit.measured} | {ratio} | {crit.target:g} | "
                     f"**{crit.verdict}** |")
    lines += ["", "Criterion 5 is also checked by `tests/unit/test_bench_serving.py` against a "
              "fake server with known timings.", "", "## Commands", "",
              "Servers (each on a free 127.0.0.1 port, started and stopped by the suite):", "",
              "```"]
    lines += [f"{cmd}" for cmd in res.servers.values()]
    lines += ["```", "", "Benchmarks, in the order they ran:", "", "```"]
    lines += [f"{r.command()}" for r in res.all_runs()]
    lines += ["```", ""]
    if res.errors or any(not r.ok for r in res.all_runs()):
        lines += ["## Failures", ""]
        lines += [f"- {e}" for e in res.errors]
        lines += [f"- `{r.label}` exited with {r.returncode}" for r in res.all_runs() if not r.ok]
        lines.append("")
    lines += _kept_section(md_path)
    md_path.write_text("\n".join(lines))
    return criteria


def _kept_section(md_path: Path) -> list[str]:
    """The hand-written "Where the time goes" section of the existing report, if any."""
    if md_path.exists():
        text = md_path.read_text()
        if KEEP_SECTION in text:
            return [text[text.index(KEEP_SECTION):].rstrip(), ""]
    return [KEEP_SECTION, "", "(Written by hand after a run: profiles and what limits each "
            "number.)", ""]


def plot_throughput(cfg: SuiteConfig, res: SuiteResults, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = (("shoal", res.shoal, _out_tps, "o-"),
              ("transformers serve --continuous-batching", res.transformers, _out_tps, "s-"),
              ("bare forward ceiling (batch = concurrency)", res.forward, _fwd_tps, "^--"))
    for label, runs, value, style in series:
        points = [(c, value(runs.get(c))) for c in cfg.concurrencies]
        points = [(c, v) for c, v in points if v is not None]
        if points:
            ax.plot([c for c, _ in points], [v for _, v in points], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(cfg.concurrencies), [str(c) for c in cfg.concurrencies])
    ax.set_xlabel("concurrency (requests in flight) / decode batch")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"SmolLM2-135M float32 on CPU: random {cfg.input_len} in / "
                 f"{cfg.output_len} out" + (" (quick)" if cfg.quick else ""))
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
