"""The `make bench` report: docs/benchmarks.md (machine, workload, tables, the acceptance ratios,
exact commands) and the throughput plot, from a finished suite run. The report's hand-written
part, from "Where the time goes" to the end, is kept as it is; the history of runs lives in
docs/perf-log.md, which the suite never writes."""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
from pathlib import Path

import psutil

from shoal.bench.acceptance import (
    Criterion,
    acceptance,
    ceiling_rounds,
    fmt,
    fwd_tps,
    generate_tps,
    median_ratio,
    out_tps,
    round_ratios,
    throughput_rounds,
)
from shoal.bench.suite_runs import (
    LLAMA_F32,
    LLAMA_Q8,
    SHOAL,
    SHOAL_INT8,
    SPECULATION_DATASETS,
    SYSTEMS,
    TRANSFORMERS,
    Run,
    Shape,
    SuiteConfig,
    SuiteResults,
    median_run,
)
from shoal.cpu_cores import usable_cores
from shoal.engine.threads import torch_threads_per_rank

KEEP_SECTION = "## Where the time goes"
PERF_LOG = "perf-log.md"  # beside the report: the hand-written history of runs
CPU_FLAGS = ("avx", "fma", "f16c", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def machine_info() -> dict[str, str]:
    import torch
    import transformers

    cpu, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    from shoal import __version__ as shoal_version

    return {"cpu": cpu, "cpu flags (of interest)": " ".join(f for f in CPU_FLAGS if f in flags),
            "cores": str(os.cpu_count()),
            "memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
            "os": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "shoal": shoal_version}


def _threads_note(cfg: SuiteConfig) -> str:
    cores = usable_cores()
    threads = torch_threads_per_rank(cores, 1, spare_core=False)
    llama, trials = cfg.llama_threads(cores), cfg.llama_thread_trials(cores)
    return (f"Threads: shoal's scheduler and the bare forward use {threads} torch thread(s) "
            f"for every step (one rank on every core; on CPU the scheduler runs its plain loop, "
            f"not the overlap loop); `transformers serve` runs with OMP_NUM_THREADS="
            f"{cfg.hf_threads(cores)} (on 2 cores its default of one thread per core ran ~5x "
            f"slower next to its own HTTP thread and the benchmark client); `llama-server` runs "
            f"with `-t {llama} -tb {cores}` (one thread per physical core, as llama.cpp's docs "
            f"advise, like shoal's forward)"
            + (f", and once with `-t {', '.join(map(str, trials))}` at concurrency 1 and "
               f"{cfg.ratio_concurrency} (table below)" if trials else "")
            + f"; `generate` runs on "
            f"{{{', '.join(map(str, cfg.generate_threads(cores)))}}} threads, the faster one "
            f"in each round.")


def _latency_rows(res: SuiteResults) -> list[str]:
    rows = []
    for (system, shape, c), runs in sorted(res.serving.items(),
                                           key=lambda kv: (SYSTEMS.index(kv[0][0]), kv[0][1:])):
        r = None if (run := median_run(runs)) is None else run.result
        if r is None:
            continue
        t, i, p, e = r["ttft_ms"], r["itl_ms"], r["tpot_ms"], r["e2e_latency_ms"]
        rows.append(f"| {system} | {shape[0]} / {shape[1]} | {c} | {fmt(t['mean'])} | "
                    f"{fmt(t['p50'])} | {fmt(t['p99'])} | {fmt(i['mean'])} | {fmt(i['p99'])} | "
                    f"{fmt(p['mean'])} | {fmt(p['p99'])} | {fmt(e['mean'])} | "
                    f"{fmt(e['p99'])} |")
    return rows


def _workload(cfg: SuiteConfig) -> list[str]:
    extra = ", ".join(f"{i} in / {o} out" for i, o in cfg.shapes[1:])
    shared = ", ".join(f"{p} + {s}" for p, s in cfg.shared_shapes)
    return [
        f"- random dataset: {cfg.input_len} prompt tokens, {cfg.output_len} output tokens "
        f"(EOS ignored, greedy), at concurrency {', '.join(map(str, cfg.concurrencies))}"
        + (f"; also {extra} at concurrency {cfg.ratio_concurrency}" if extra else "")
        + f"; num-prompts = max({cfg.min_prompts}, {cfg.waves} x concurrency), one seed per "
        f"workload and round (no run repeats the start of another's prompts); all requests "
        f"are sent at once and `--max-concurrency` keeps that many in flight. Every server "
        f"gets the same prompts (text; each server tokenizes it).",
        f"- int8: `shoal serve --quantization w8a16` and llama.cpp on Q8_0, main shape, at "
        f"concurrency {', '.join(map(str, cfg.int8_concurrencies))}.",
        "- llama.cpp: the embedded Q4_1 GGUF requantized by `llama-quantize --allow-requantize` "
        "to F32 (the weights shoal serves, dequantized to float32) and Q8_0; a `llama-server` "
        "per GGUF and concurrency with `-np` = concurrency and continuous batching (the F32 and "
        "Q8_0 ones up together through their phase's rounds, the idle one using no CPU).",
        f"- shared-prefix dataset: {cfg.shared_num_prompts} requests of one common prefix + a "
        f"unique suffix (prefix + suffix tokens: {shared}), {cfg.shared_output_len} output "
        f"tokens, concurrency {cfg.shared_concurrency}, with and without "
        f"`--disable-radix-cache`. The cache starts cold (`/flush_cache`, and the warmup "
        f"request shares no prefix with the dataset), so the first wave pays the prefix.",
        f"- bare forward: `shoal bench forward` with as many requests as the concurrency, "
        f"the model's work of a main-shape run with no server in the loop: their "
        f"{cfg.input_len}-token prompts prefilled in forwards of at most the scheduler's "
        f"chunked-prefill budget (each request's first token), then {cfg.output_len - 1} "
        f"decode steps at that batch; its tokens/s is all {cfg.output_len} output tokens of "
        f"each over the time of those forwards. It runs right after each of shoal's serving "
        f"runs at that concurrency (the server up and idle).",
        f"- rounds: at each concurrency the main-shape runs of shoal (with its bare forward), "
        f"llama.cpp F32 and, at the int8 concurrencies, shoal w8a16 and llama.cpp Q8_0 are "
        f"repeated {cfg.rounds} times in turns, each round on its own prompts; the other shapes "
        f"and transformers serve run once. A table's value is the round of median throughput "
        f"(its latencies too); a ratio of two systems measured in rounds is the median of the "
        f"rounds' ratios (each of two runs seconds apart: what this host gives moves 30-50% "
        f"between minutes), against a system measured once the ratio of the median round to "
        f"that run.",
        "- transformers `generate`: batch 1, the main shape, on each thread count in every "
        "round of concurrency 1 right after shoal's bare forward (a prompt made like the "
        "random dataset's, with the round's seed); "
        "tokens/s = output tokens / generate time (prefill included, as in a serving "
        "request). The single-stream ratio pairs each round's shoal run with that round's "
        "faster `generate`; the table shows each thread count's median round.",
        f"- speculative decoding: two `shoal serve`s up together, one with "
        f"`--speculative-algorithm ngram` (4 draft tokens), one without; in each of "
        f"{cfg.rounds} rounds each dataset runs on one and then the other with the same "
        f"prompts: {cfg.speculation_num_prompts} requests at concurrency 1, greedy, "
        f"{cfg.speculation_shape[0]} prompt tokens (`repeat`: a text of that many random words "
        f"the request asks to repeat, as an edit or a summary copies its input; `random`: "
        f"random tokens) and {cfg.speculation_shape[1]} output tokens (EOS ignored). Tokens "
        f"per verify step: the ngram server's `/server_info` counters over each run.",
    ]


def _throughput_table(cfg: SuiteConfig, res: SuiteResults) -> list[str]:
    lines = ["| concurrency | shoal | shoal w8a16 | llama.cpp F32 | llama.cpp Q8_0 | "
             "transformers serve CB | bare forward (batch = c) | shoal / llama.cpp F32 | "
             "w8a16 / Q8_0 | shoal / transformers | shoal / bare forward |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cfg.concurrencies:
        v = {s: out_tps(res.get(s, c, cfg.shape)) for s in SYSTEMS}
        lines.append(
            f"| {c} | {fmt(v[SHOAL])} | {fmt(v[SHOAL_INT8])} | {fmt(v[LLAMA_F32])} | "
            f"{fmt(v[LLAMA_Q8])} | {fmt(v[TRANSFORMERS])} | {fmt(fwd_tps(res.forward.get(c)))} | "
            f"{fmt(_vs(res, SHOAL, LLAMA_F32, c, cfg.shape), 2)} | "
            f"{fmt(_vs(res, SHOAL_INT8, LLAMA_Q8, c, cfg.shape), 2)} | "
            f"{fmt(_vs(res, SHOAL, TRANSFORMERS, c, cfg.shape), 2)} | "
            f"{fmt(median_ratio(ceiling_rounds(res, c, cfg.shape)), 2)} |")
    return lines


def _vs(res: SuiteResults, a: str, b: str, c: int, shape: Shape) -> float | None:
    return median_ratio(throughput_rounds(res, a, b, c, shape))


def _shapes_table(cfg: SuiteConfig, res: SuiteResults) -> list[str]:
    c = cfg.ratio_concurrency
    lines = [f"Concurrency {c}; output tok/s (mean TTFT in ms).", "",
             "| in / out | shoal | llama.cpp F32 | transformers serve CB | shoal / llama.cpp "
             "| shoal / transformers |", "|---|---:|---:|---:|---:|---:|"]
    for s in cfg.shapes:
        runs = {sys_: res.get(sys_, c, s) for sys_ in (SHOAL, LLAMA_F32, TRANSFORMERS)}

        def cell(run: Run | None) -> str:
            r = None if run is None else run.result
            return "n/a" if r is None else \
                f"{r['output_throughput']:.1f} ({r['ttft_ms']['mean']:.0f})"

        lines.append(f"| {s[0]} / {s[1]} | {cell(runs[SHOAL])} | {cell(runs[LLAMA_F32])} | "
                     f"{cell(runs[TRANSFORMERS])} | {fmt(_vs(res, SHOAL, LLAMA_F32, c, s), 2)} | "
                     f"{fmt(_vs(res, SHOAL, TRANSFORMERS, c, s), 2)} |")
    return lines


def _llama_threads_table(cfg: SuiteConfig, res: SuiteResults) -> list[str]:
    if not res.llama_threads:
        return []
    main = cfg.llama_threads(usable_cores())
    lines = ["", "### llama.cpp thread counts", "",
             f"llama.cpp F32, {cfg.input_len} in / {cfg.output_len} out; output tok/s (mean "
             f"TPOT in ms).", "", "| `-t` | concurrency | output tok/s | TPOT mean |",
             "|---:|---:|---:|---:|"]
    rows = [(main, c, res.get(LLAMA_F32, c, cfg.shape)) for _, c in res.llama_threads]
    rows += [(t, c, run) for (t, c), run in res.llama_threads.items()]
    for t, c, run in sorted(rows, key=lambda row: (row[1], row[0])):
        r = None if run is None else run.result
        lines.append(f"| {t} | {c} | {fmt(out_tps(run))} | "
                     f"{fmt(None if r is None else r['tpot_ms']['mean'])} |")
    return lines


def _shared_table(cfg: SuiteConfig, res: SuiteResults) -> list[str]:
    lines = ["| prefix + suffix | shoal | TTFT mean (ms) | TTFT p50 | TTFT p99 | input tok/s | "
             "output tok/s | duration (s) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for s in cfg.shared_shapes:
        for radix in (True, False):
            run = res.shared.get((radix, s))
            r = None if run is None else run.result
            if r is not None:
                t = r["ttft_ms"]
                lines.append(f"| {s[0]} + {s[1]} | "
                             f"{'radix cache' if radix else '--disable-radix-cache'} | "
                             f"{fmt(t['mean'])} | {fmt(t['p50'])} | {fmt(t['p99'])} | "
                             f"{fmt(r['input_throughput'])} | {fmt(r['output_throughput'])} | "
                             f"{fmt(r['duration_s'])} |")
    return lines


def _speculation_table(res: SuiteResults) -> list[str]:
    lines = ["| dataset | no speculation (tok/s) | ngram (tok/s) | tokens per verify step | "
             "ngram / none (median of rounds) |", "|---|---:|---:|---:|---:|"]
    for dataset in SPECULATION_DATASETS:
        with_ = res.speculation.get((dataset, True), [])
        without = res.speculation.get((dataset, False), [])
        if with_ or without:
            accepts = res.accept_lengths.get(dataset)
            lines.append(f"| {dataset} | {fmt(out_tps(median_run(without)))} | "
                         f"{fmt(out_tps(median_run(with_)))} | "
                         f"{fmt(statistics.median(accepts) if accepts else None, 2)} | "
                         f"{fmt(median_ratio(round_ratios(with_, without, out_tps)), 2)} |")
    return lines


def _single_stream(cfg: SuiteConfig, res: SuiteResults) -> list[str]:
    lines = ["| | tokens/s | decode only (tokens/s) |", "|---|---:|---:|"]
    for system in SYSTEMS:
        r = (run := res.get(system, 1, cfg.shape)) and run.result
        if r:
            tpot = r["tpot_ms"]["mean"]
            lines.append(f"| {system}, concurrency 1 | {fmt(r['output_throughput'], 2)} | "
                         f"{fmt(None if not tpot else 1000 / tpot, 2)} (1000 / TPOT) |")
    for threads, rounds in sorted(res.generate.items()):
        run = median_run(rounds, generate_tps)
        if run is not None and run.data:
            lines.append(f"| transformers generate, batch 1, {threads} threads "
                         f"| {fmt(run.data['tokens_per_s'], 2)} | "
                         f"{fmt(run.data['decode_tokens_per_s'], 2)} |")
    return lines


def _acceptance_table(criteria: list[Criterion]) -> list[str]:
    lines = ["| criterion | measured | ratio | target | |", "|---|---|---:|---:|---|"]
    for crit in criteria:
        verdict = crit.verdict if crit.counted else f"**{crit.verdict}**"
        lines.append(f"| {crit.name} | {crit.measured} | {fmt(crit.ratio, 2)} | "
                     f"{crit.target:g} | {verdict} |")
    return lines


def write_report(cfg: SuiteConfig, res: SuiteResults, machine: dict[str, str],
                 wall_s: float, md_path: Path, png_path: Path) -> list[Criterion]:
    criteria = acceptance(cfg, res)
    lines = [
        "# Benchmarks", "",
        f"Produced by `make bench` (`python -m shoal.bench.suite`) on "
        f"{dt.date.today().isoformat()} in {wall_s / 60:.1f} minutes"
        f"{' — QUICK MODE, not a result' if cfg.quick else ''}. Model: SmolLM2-135M-Instruct "
        f"on CPU (float32, and weight-only int8). Regenerate with `make bench` (it builds "
        f"llama.cpp first); `make bench BENCH_ARGS=--quick` is a smoke run.", "",
        "## Machine", "", "| | |", "|---|---|",
        *[f"| {k} | {v} |" for k, v in machine.items()], "",
        _threads_note(cfg), "",
        "## Workload", "", *_workload(cfg), "",
        f"## Output throughput (tokens/s), random {cfg.input_len} in / {cfg.output_len} out", "",
        f"![output throughput vs concurrency]({png_path.name})", "",
        *_throughput_table(cfg, res), "",
        "## Other shapes", "", *_shapes_table(cfg, res),
        *_llama_threads_table(cfg, res), "",
        "## Latency (ms), random dataset", "",
        "TTFT: request sent to the first streamed chunk with text; ITL: gaps between chunks "
        "with text, pooled; TPOT: (e2e - TTFT) / (output tokens - 1), tokens from the server's "
        "`usage`; e2e: request sent to stream closed.", "",
        "| server | in / out | concurrency | TTFT mean | TTFT p50 | TTFT p99 | ITL mean | "
        "ITL p99 | TPOT mean | TPOT p99 | e2e mean | e2e p99 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *_latency_rows(res), "",
        "## Shared prefix", "", *_shared_table(cfg, res), "",
        "## Single stream", "", *_single_stream(cfg, res), "",
        "## Speculative decoding", "", *_speculation_table(res), "",
        "## Acceptance", "", *_acceptance_table(criteria), "",
        "The int8 quality criterion (greedy agreement, logprob difference, perplexity) is "
        f"measured by `tests/integration/test_quantization.py`; its figures are in "
        f"[{PERF_LOG}]({PERF_LOG}). `tests/unit/test_bench_serving.py` checks the benchmark "
        f"client against a fake server with known timings.", "",
        "## Commands", "",
        "Servers (each on a free 127.0.0.1 port, started and stopped by the suite):", "",
        "```", *res.servers.values(), "```", "",
        "Benchmarks, in the order they ran:", "",
        "```", *(r.command() for r in res.all_runs()), "```", ""]
    if res.notes:
        lines += ["## Notes", "", *(f"- {n}" for n in res.notes), ""]
    failed = [r for r in res.all_runs() if not r.ok]
    if res.errors or failed:
        lines += ["## Failures", "", *(f"- {e}" for e in res.errors),
                  *(f"- `{r.label}` exited with {r.returncode}" for r in failed), ""]
    lines += _kept_sections(md_path)
    md_path.write_text("\n".join(lines))
    return criteria


def _kept_sections(md_path: Path) -> list[str]:
    """An existing report from its hand-written "Where the time goes" section to the end: that
    section (a pointer to the performance log, docs/perf-log.md, which the suite never writes)
    and the other benchmarks' sections after it."""
    if md_path.exists():
        text = md_path.read_text()
        if KEEP_SECTION in text:
            return [text[text.index(KEEP_SECTION):].rstrip(), ""]
    return [KEEP_SECTION, "", f"Profiles of the runs and the experiments between them: "
            f"[{PERF_LOG}]({PERF_LOG}) (written by hand).", ""]


def plot_throughput(cfg: SuiteConfig, res: SuiteResults, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    styles = {SHOAL: "o-", SHOAL_INT8: "o:", LLAMA_F32: "D-", LLAMA_Q8: "D:",
              TRANSFORMERS: "s-"}
    for system in SYSTEMS:
        points = [(c, out_tps(res.get(system, c, cfg.shape))) for c in cfg.concurrencies]
        if any(v is not None for _, v in points):
            ax.plot(*zip(*((c, v) for c, v in points if v is not None)), styles[system],
                    label=system)
    ceiling = [(c, fwd_tps(res.forward.get(c))) for c in cfg.concurrencies]
    if any(v is not None for _, v in ceiling):
        ax.plot(*zip(*((c, v) for c, v in ceiling if v is not None)), "^--",
                label="bare forward ceiling (batch = concurrency)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(cfg.concurrencies), [str(c) for c in cfg.concurrencies])
    ax.set_xlabel("concurrency (requests in flight) / decode batch")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"SmolLM2-135M on CPU: random {cfg.input_len} in / {cfg.output_len} out"
                 + (" (quick)" if cfg.quick else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)

