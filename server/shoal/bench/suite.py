"""`make bench`: shoal vs `transformers serve --continuous-batching` vs the bare-forward ceiling.

One run on one machine, the same workload for everyone:
    1. `shoal bench forward` at batch B = each concurrency (nothing else running);
    2. transformers `generate` at batch 1 (best of 1 thread and all cores);
    3. `shoal serve`: the random dataset at each concurrency, then the shared-prefix dataset;
    4. `shoal serve --disable-radix-cache`: the shared-prefix dataset;
    5. `transformers serve --continuous-batching`: the random dataset at each concurrency.
Every serving run is `shoal bench serving` as a subprocess; its command line goes into the report.
Writes docs/benchmarks.md (the section "Where the time goes" of an existing file is kept) and
docs/benchmarks_throughput.png; raw JSON goes to --results-dir.

`python -m shoal.bench.suite --quick` is a few-minute smoke version of the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from shoal import model_store
from shoal.scheduler.process import torch_threads_per_rank

STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
KEEP_SECTION = "## Where the time goes"
ACCEPT_VS_TRANSFORMERS = 2.0
ACCEPT_VS_CEILING = 0.8
ACCEPT_SINGLE_STREAM = 1.3
ACCEPT_RADIX_TTFT = 4.0


@dataclass(frozen=True)
class SuiteConfig:
    concurrencies: tuple[int, ...] = (1, 4, 16, 32, 64)
    input_len: int = 64
    output_len: int = 128
    min_prompts: int = 4           # num_prompts at concurrency c = max(min_prompts, c * waves)
    waves: int = 1
    prefix_len: int = 1024
    suffix_len: int = 32
    shared_num_prompts: int = 128
    shared_output_len: int = 16
    shared_concurrency: int = 16
    forward_steps: int = 16
    generate_repeats: int = 2
    ratio_concurrency: int = 32    # acceptance 1 and 2 are read at this concurrency
    seed: int = 0
    skip_transformers: bool = False
    quick: bool = False

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, concurrency * self.waves)

    @property
    def forward_context_len(self) -> int:
        """The mean KV context of a random-dataset request while it decodes."""
        return self.input_len + self.output_len // 2


QUICK = dict(concurrencies=(1, 4, 32), input_len=32, output_len=16, min_prompts=2,
             prefix_len=256, suffix_len=16, shared_num_prompts=16, shared_output_len=4,
             shared_concurrency=8, forward_steps=4, generate_repeats=1, quick=True)


# -- processes ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]
    base_url: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env}, start_new_session=True)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} during "
                                   f"startup; log: {self.log_path}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy after {STARTUP_TIMEOUT_S:.0f} s; "
                           f"log: {self.log_path}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL of the session this server leads (its children included)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def command(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(_display_argv(self.argv))


def _display_argv(argv: list[str]) -> list[str]:
    """`python -m shoal ...` as the user types it: `shoal ...`."""
    if argv[1:3] == ["-m", "shoal"]:
        return ["shoal", *argv[3:]]
    if argv[1:2] == ["-m"]:
        return ["python", *argv[1:]]
    return [Path(argv[0]).name, *argv[1:]]


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def shoal_server(log_dir: Path, *flags: str) -> Server:
    port = free_port()
    tag = "-no-radix" if "--disable-radix-cache" in flags else ""
    return Server(f"shoal{tag}", [sys.executable, "-m", "shoal", "serve", "--port", str(port),
                                  *flags], {}, f"http://127.0.0.1:{port}",
                  log_dir / f"shoal{tag}.log")


def transformers_server(model_path: str, threads: int, log_dir: Path) -> Server:
    port = free_port()
    argv = [_bin("transformers"), "serve", model_path, "--continuous-batching", "--device", "cpu",
            "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "info"]
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    return Server("transformers", argv, env, f"http://127.0.0.1:{port}",
                  log_dir / "transformers.log")


@dataclass
class Run:
    """One subprocess benchmark: its command line and its JSON output (None if it failed)."""
    label: str
    argv: list[str]
    output_file: Path
    returncode: int | None = None
    data: dict[str, Any] | None = None
    seconds: float = 0.0

    def execute(self) -> Run:
        print(f"[suite] {self.label}: {self.command()}", file=sys.stderr, flush=True)
        start = time.monotonic()
        self.returncode = subprocess.run(self.argv).returncode
        self.seconds = time.monotonic() - start
        if self.output_file.exists():
            self.data = json.loads(self.output_file.read_text())
        if self.returncode != 0:
            print(f"[suite] {self.label} FAILED (exit {self.returncode})", file=sys.stderr)
        return self

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.data is not None

    def command(self) -> str:
        return shlex.join(_display_argv(self.argv))


def serving_run(label: str, server: Server, results: Path, *args: str) -> Run:
    out = results / f"serving-{label}.json"
    argv = [sys.executable, "-m", "shoal", "bench", "serving", "--base-url", server.base_url,
            *args, "--output-file", str(out)]
    return Run(label, argv, out).execute()


def random_args(cfg: SuiteConfig, concurrency: int) -> list[str]:
    return ["--dataset", "random", "--num-prompts", str(cfg.num_prompts(concurrency)),
            "--input-len", str(cfg.input_len), "--output-len", str(cfg.output_len),
            "--max-concurrency", str(concurrency), "--seed", str(cfg.seed)]


def shared_prefix_args(cfg: SuiteConfig) -> list[str]:
    return ["--dataset", "shared-prefix", "--num-prompts", str(cfg.shared_num_prompts),
            "--prefix-len", str(cfg.prefix_len), "--suffix-len", str(cfg.suffix_len),
            "--output-len", str(cfg.shared_output_len), "--max-concurrency",
            str(cfg.shared_concurrency), "--seed", str(cfg.seed)]


# -- the run --------------------------------------------------------------------------------


@dataclass
class SuiteResults:
    forward: dict[int, Run] = dataclasses.field(default_factory=dict)
    generate: list[Run] = dataclasses.field(default_factory=list)
    shoal: dict[int, Run] = dataclasses.field(default_factory=dict)
    transformers: dict[int, Run] = dataclasses.field(default_factory=dict)
    radix: Run | None = None
    no_radix: Run | None = None
    servers: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> command
    errors: list[str] = dataclasses.field(default_factory=list)

    def all_runs(self) -> list[Run]:
        runs = [*self.forward.values(), *self.generate, *self.shoal.values(),
                *self.transformers.values(), self.radix, self.no_radix]
        return [r for r in runs if r is not None]


def run_suite(cfg: SuiteConfig, results: Path) -> SuiteResults:
    model_path = str(model_store.prepare())
    threads = torch_threads_per_rank(os.cpu_count() or 1, 1)
    res = SuiteResults()
    for c in cfg.concurrencies:
        out = results / f"forward-b{c}.json"
        res.forward[c] = Run(f"forward-b{c}", [
            sys.executable, "-m", "shoal", "bench", "forward", "--batch-size", str(c),
            "--context-len", str(cfg.forward_context_len), "--steps", str(cfg.forward_steps),
            "--output-file", str(out)], out).execute()
    for n in sorted({threads, os.cpu_count() or 1}):
        out = results / f"generate-t{n}.json"
        res.generate.append(Run(f"generate-t{n}", [
            sys.executable, "-m", "shoal.bench.hf_generate", "--input-len", str(cfg.input_len),
            "--output-len", str(cfg.output_len), "--num-threads", str(n),
            "--repeats", str(cfg.generate_repeats), "--seed", str(cfg.seed),
            "--output-file", str(out)], out).execute())

    def serve(server: Server, body: Any) -> None:
        res.servers[server.name] = server.command()
        try:
            server.start()
            body(server)
        except RuntimeError as exc:
            res.errors.append(str(exc))
            print(f"[suite] {exc}", file=sys.stderr)
        finally:
            server.stop()

    def shoal_body(server: Server) -> None:
        for c in cfg.concurrencies:
            res.shoal[c] = serving_run(f"shoal-c{c}", server, results, *random_args(cfg, c))
        httpx.post(server.base_url + "/flush_cache", timeout=60)
        res.radix = serving_run("shoal-shared-prefix", server, results,
                                *shared_prefix_args(cfg))

    def no_radix_body(server: Server) -> None:
        res.no_radix = serving_run("shoal-shared-prefix-no-radix", server, results,
                                   *shared_prefix_args(cfg))

    def transformers_body(server: Server) -> None:
        for c in cfg.concurrencies:
            res.transformers[c] = serving_run(f"transformers-c{c}", server, results,
                                              *random_args(cfg, c))

    serve(shoal_server(results), shoal_body)
    serve(shoal_server(results, "--disable-radix-cache"), no_radix_body)
    if not cfg.skip_transformers:
        serve(transformers_server(model_path, threads, results), transformers_body)
    return res


# -- the report -----------------------------------------------------------------------------


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


def _fwd_tps(run: Run | None) -> float | None:
    r = _result(run)
    return None if r is None else float(r["tokens_per_s"])


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
    ran_both = bool(res.shoal) and (bool(res.transformers) or cfg.skip_transformers)
    all_ok = ran_both and all(r.ok for r in serving)
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
                  1.0 if all_ok else 0.0, 1.0),
    ]


def _threads_note(cfg: SuiteConfig) -> str:
    threads = torch_threads_per_rank(os.cpu_count() or 1, 1)
    return (f"torch threads: shoal's scheduler and the bare forward use {threads} (one core "
            f"per rank, one left to the api/detokenizer); `transformers serve` runs with "
            f"OMP_NUM_THREADS={threads} too (on a 2-core machine its default of all cores "
            f"ran ~5x slower next to the benchmark client); `generate` is the best of "
            f"{{{threads}, {os.cpu_count()}}} threads.")


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
        f"num-prompts = max({cfg.min_prompts}, {cfg.waves} x concurrency); all requests are "
        f"sent at once (request rate inf) and `--max-concurrency` keeps that many in flight.",
        f"- shared-prefix dataset: {cfg.shared_num_prompts} requests of one common "
        f"{cfg.prefix_len}-token prefix + a unique {cfg.suffix_len}-token suffix, "
        f"{cfg.shared_output_len} output tokens, concurrency {cfg.shared_concurrency}, with and "
        f"without `--disable-radix-cache`.",
        f"- bare forward: `shoal bench forward` at batch = concurrency, KV context "
        f"{cfg.forward_context_len} tokens (the mean context of a random-dataset request while "
        f"it decodes: {cfg.input_len} + {cfg.output_len}/2), {cfg.forward_steps} timed steps.",
        f"- transformers `generate`: batch 1, the same prompt and output lengths; tokens/s = "
        f"output tokens / generate time (prefill included, as in a serving request).",
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
    lines += ["", "Criterion 5 is also checked by `tests/unit/test_bench_serving.py` against a fake "
              "server with known timings.", "", "## Commands", "",
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
    plot_throughput(cfg, res, png_path)
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


# -- command line ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.suite",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a few-minute smoke run: concurrency 1/4/32, short prompts")
    parser.add_argument("--concurrencies", default=None, help="comma-separated, e.g. 1,4,16")
    parser.add_argument("--input-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--waves", type=int, default=None,
                        help="num-prompts = max(min, waves x concurrency)")
    parser.add_argument("--shared-num-prompts", type=int, default=None)
    parser.add_argument("--prefix-len", type=int, default=None)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--docs-dir", default=None,
                        help="where benchmarks.md and the plot go (default: docs/, or the "
                             "results folder with --quick)")
    parser.add_argument("--results-dir", default="build/bench",
                        help="raw JSON results and server logs")
    return parser


def config_from_args(ns: argparse.Namespace) -> SuiteConfig:
    cfg = SuiteConfig(**QUICK) if ns.quick else SuiteConfig()  # type: ignore[arg-type]
    overrides: dict[str, Any] = {}
    if ns.concurrencies:
        overrides["concurrencies"] = tuple(int(c) for c in ns.concurrencies.split(","))
    for name in ("input_len", "output_len", "waves", "shared_num_prompts", "prefix_len"):
        if getattr(ns, name) is not None:
            overrides[name] = getattr(ns, name)
    if ns.skip_transformers:
        overrides["skip_transformers"] = True
    cfg = dataclasses.replace(cfg, **overrides)
    if cfg.ratio_concurrency not in cfg.concurrencies:
        cfg = dataclasses.replace(cfg, ratio_concurrency=max(cfg.concurrencies))
    return cfg


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    cfg = config_from_args(ns)
    results = Path(ns.results_dir) / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    results.mkdir(parents=True, exist_ok=True)
    docs = Path(ns.docs_dir or (results if cfg.quick else "docs"))
    docs.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    start = time.monotonic()
    res = run_suite(cfg, results)
    wall_s = time.monotonic() - start
    (results / "suite.json").write_text(json.dumps(
        {"config": dataclasses.asdict(cfg), "machine": machine, "wall_s": wall_s,
         "servers": res.servers, "errors": res.errors}, indent=2) + "\n")
    criteria = write_report(cfg, res, machine, wall_s, docs / "benchmarks.md",
                            docs / "benchmarks_throughput.png")
    print(f"[suite] done in {wall_s / 60:.1f} min; wrote {docs / 'benchmarks.md'} and "
          f"{docs / 'benchmarks_throughput.png'}; raw results in {results}", file=sys.stderr)
    for crit in criteria:
        print(f"[suite] {crit.verdict:4} {crit.name}: {crit.measured}", file=sys.stderr)
    failed = res.errors or any(not r.ok for r in res.all_runs())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
