"""`make bench`: shoal (float32 and w8a16) vs llama.cpp's `llama-server` (F32 and Q8_0 of the
same weights) vs `transformers serve --continuous-batching` vs the bare-forward ceiling.

One run on one machine, the same workload for everyone:
    1. one phase per concurrency c, those the acceptance ratios read first (1, the ratio
       concurrency, the int8 ones, then the rest), in head-to-head rounds
       (`SuiteConfig.rounds`; each round its own prompts): `shoal serve` on the random dataset
       and right after it `shoal bench forward` at batch c (the server up and idle), at c = 1
       then transformers `generate` at batch 1 (1 thread and all cores),
       `llama-server` on the F32 GGUF with `-np` c, and at the int8 concurrencies `shoal serve
       --quantization w8a16` and `llama-server` on the Q8_0 GGUF, in turns, so that each ratio
       is the median of ratios of runs seconds apart (what this shared 2-core host gives moves
       30-50% between minutes); then at the ratio concurrency the other random shapes on shoal
       and llama.cpp F32 once, and `transformers serve --continuous-batching` (a server of the
       phase's own) once on every workload of the phase;
    2. once every other server has stopped, the shared-prefix dataset at each prefix/suffix
       shape on a shoal server of its own (cache flushed first), then on one with
       `--disable-radix-cache` (both with a KV pool sized for these shapes);
    3. `llama-server` F32 at the other thread counts, at concurrency 1 and the ratio concurrency.
Every serving run is `shoal bench serving` as a subprocess; its command line goes into the report.
Writes docs/benchmarks.md (from its section "Where the time goes" to the end, an existing file
is kept; docs/perf-log.md is never written) and docs/benchmarks_throughput.png after each
phase, so that a run cut short leaves what it measured; raw JSON goes to --results-dir.

`python -m shoal.bench.suite --quick` is a few-minute smoke version of the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from shoal import model_store
from shoal.bench import llama_cpp
from shoal.bench.acceptance import acceptance
from shoal.bench.report import machine_info, plot_throughput, write_report
from shoal.bench.servers import Server, llama_server, shoal_server, transformers_server
from shoal.bench.suite_runs import (
    LLAMA_F32,
    LLAMA_Q8,
    QUICK,
    SHOAL,
    SHOAL_INT8,
    SPECULATION_DATASETS,
    TRANSFORMERS,
    Run,
    Shape,
    SuiteConfig,
    SuiteResults,
)
from shoal.cpu_cores import usable_cores

# what starting or talking to a benchmarked server may raise; recorded, and the run goes on
SERVER_ERRORS = (RuntimeError, OSError, httpx.HTTPError)


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text).strip("-")


def serving_run(label: str, server: Server, results: Path, *args: str) -> Run:
    out = results / f"serving-{label}.json"
    argv = [sys.executable, "-m", "shoal", "bench", "serving", "--base-url", server.base_url,
            *args, "--disable-progress", "--output-file", str(out)]
    return Run(label, argv, out).execute()


def forward_run(label: str, cfg: SuiteConfig, batch_size: int, results: Path) -> Run:
    out = results / f"{label}.json"
    return Run(label, [sys.executable, "-m", "shoal", "bench", "forward", "--batch-size",
                       str(batch_size), "--input-len", str(cfg.input_len), "--output-len",
                       str(cfg.output_len), "--output-file", str(out)], out).execute()


def generate_run(label: str, cfg: SuiteConfig, threads: int, round_: int, results: Path
                 ) -> Run:
    """transformers `generate` at batch 1 on a prompt made with the round's seed."""
    out = results / f"{label}.json"
    return Run(label, [sys.executable, "-m", "shoal.bench.hf_generate", "--input-len",
                       str(cfg.input_len), "--output-len", str(cfg.output_len), "--num-threads",
                       str(threads), "--repeats", str(cfg.generate_repeats), "--seed",
                       str(cfg.seed_for(cfg.shape, 1, round_)), "--output-file", str(out)],
               out).execute()


def random_args(cfg: SuiteConfig, shape: Shape, concurrency: int, round_: int = 0) -> list[str]:
    return ["--dataset", "random", "--num-prompts", str(cfg.num_prompts(concurrency)),
            "--input-len", str(shape[0]), "--output-len", str(shape[1]),
            "--max-concurrency", str(concurrency),
            "--seed", str(cfg.seed_for(shape, concurrency, round_))]


def shared_prefix_args(cfg: SuiteConfig, shape: Shape) -> list[str]:
    return ["--dataset", "shared-prefix", "--num-prompts", str(cfg.shared_num_prompts),
            "--prefix-len", str(shape[0]), "--suffix-len", str(shape[1]),
            "--output-len", str(cfg.shared_output_len), "--max-concurrency",
            str(cfg.shared_concurrency), "--seed", str(cfg.seed)]


def speculation_args(cfg: SuiteConfig, dataset: str, round_: int) -> list[str]:
    """One stream, greedy (the client's default), the round's own prompts."""
    prompt, output = cfg.speculation_shape
    return ["--dataset", dataset, "--num-prompts", str(cfg.speculation_num_prompts),
            "--input-len", str(prompt), "--output-len", str(output), "--max-concurrency", "1",
            "--seed", str(cfg.seed + 7 + 1_000_000 * round_)]


def verify_counts(server: Server) -> tuple[int, int]:
    """The server's verify steps and the tokens they yielded so far (speculative decoding);
    zeros when it does not say."""
    try:
        scheduler = httpx.get(f"{server.base_url}/server_info", timeout=30).json()["scheduler"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0, 0
    return int(scheduler.get("num_verify_steps", 0)), int(scheduler.get("num_verified_tokens", 0))


def random_label(system: str, shape: Shape, concurrency: int) -> str:
    return f"{_slug(system)}-{shape[0]}x{shape[1]}-c{concurrency}"


# -- the run --------------------------------------------------------------------------------


class Suite:
    """The run, one concurrency at a time (`SuiteConfig.phase_order`): every server measured at
    that concurrency back to back, in rounds, so that each ratio compares runs seconds apart on
    a host whose load drifts, and a run cut short has whole comparisons. shoal's servers stay
    up across phases; the `llama-server`s (F32, and Q8_0 at the int8 concurrencies, `-np` =
    concurrency) and `transformers serve` are started per phase (transformers' model process
    kept ~14 GB after a 32-stream phase, and with shoal's servers and the bare forward at 64
    rows beside it the 24 GB host ran out of memory and thrashed).
    `on_progress` runs after each phase."""

    def __init__(self, cfg: SuiteConfig, results: Path, llama_bin: Path | None,
                 on_progress: Callable[[SuiteResults], None] | None = None) -> None:
        self.cfg = cfg
        self.results = results
        self.llama_bin = llama_bin
        self.on_progress = on_progress
        self.res = SuiteResults()
        self.llama_threads = cfg.llama_threads(usable_cores())
        self.kv = ("--max-total-tokens", str(cfg.kv_tokens))
        self.up: dict[str, Server] = {}
        self.failed: set[str] = set()
        self.no_repack: set[Path] = set()  # GGUFs whose llama-server runs with --no-repack

    def progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.res)

    def server(self, make: Callable[[], Server]) -> Server | None:
        """A server that stays up until the run ends: started on first use, and again if it
        died since (recorded as an error); None if it would not start."""
        server = make()
        if server.name in self.failed:
            return None
        if server.name in self.up:
            if self.up[server.name].alive():
                return self.up[server.name]
            dead = self.up.pop(server.name)
            self.res.errors.append(f"{server.name} exited with {dead.exit_code()} during the "
                                   f"run (log: {dead.log_path}); started again")
        if not self.start(server):
            self.failed.add(server.name)
            return None
        self.up[server.name] = server
        return server

    def serve(self, server: Server, body: Callable[[Server], None]) -> None:
        """A server for `body` only."""
        try:
            if self.start(server):
                body(server)
        except SERVER_ERRORS as exc:
            self.record_error(server, exc)
        finally:
            server.stop()

    def phase_server(self, stack: contextlib.ExitStack, server: Server) -> Server | None:
        """`server` started until `stack` closes; None if it would not start."""
        stack.callback(server.stop)
        return server if self.start(server) else None

    def start(self, server: Server) -> bool:
        """Start `server`, its command recorded; False (the error recorded) if it would not."""
        exc = self.try_start(server)
        if exc is not None:
            self.record_error(server, exc)
        return exc is None

    def try_start(self, server: Server) -> Exception | None:
        """Start `server`, its command recorded; what it raised if it would not start."""
        self.res.servers[server.name] = server.command()
        try:
            server.start()
        except SERVER_ERRORS as exc:
            return exc
        return None

    def record_error(self, server: Server, exc: Exception) -> None:
        self.res.errors.append(f"{server.name}: {type(exc).__name__}: {exc}")
        print(f"[suite] {exc}", file=sys.stderr)

    def random(self, system: str, server: Server, shape: Shape, concurrency: int,
               round_: int | None = None) -> None:
        """One run of the random dataset; `round_` numbers a head-to-head round (its own
        prompts, `SuiteConfig.seed_for`)."""
        label = random_label(system, shape, concurrency)
        self.res.serving.setdefault((system, shape, concurrency), []).append(serving_run(
            label if round_ is None else f"{label}-r{round_ + 1}", server, self.results,
            *random_args(self.cfg, shape, concurrency, round_ or 0)))

    def randoms(self, system: str, work: list[tuple[Shape, int]]) -> Callable[[Server], None]:
        def body(server: Server) -> None:
            for shape, c in work:
                self.random(system, server, shape, c)
        return body

    def run(self) -> SuiteResults:
        cfg = self.cfg
        llama = self.llama_ggufs() if not cfg.skip_llama_cpp else None
        try:
            for c in cfg.phase_order():
                self.phase(c, llama)
                self.progress()
        finally:
            for server in self.up.values():
                server.stop()
            self.up.clear()
        shared_kv = ("--max-total-tokens", str(cfg.shared_kv_tokens))
        self.serve(shoal_server(self.results, f"{SHOAL} shared prefix", *shared_kv),
                   self.shared_prefixes(radix=True))
        self.serve(shoal_server(self.results, f"{SHOAL} shared prefix --disable-radix-cache",
                                *shared_kv, "--disable-radix-cache"),
                   self.shared_prefixes(radix=False))
        self.progress()
        self.speculation_rounds()
        self.progress()
        if llama is not None:
            for t in cfg.llama_thread_trials(usable_cores()):
                for c in sorted({1, cfg.ratio_concurrency} & set(cfg.concurrencies)):
                    self.llama_trial(llama[0], c, t)
            self.progress()
        return self.res

    def speculation_rounds(self) -> None:
        """`shoal serve` with and without `--speculative-algorithm ngram`, both up: in each
        round, each dataset on one and then the other (seconds apart, the same prompts)."""
        with contextlib.ExitStack() as stack:
            servers = {speculating: self.phase_server(stack, shoal_server(
                self.results, f"{SHOAL} {'ngram' if speculating else 'no speculation'}",
                *self.kv, *(("--speculative-algorithm", "ngram") if speculating else ())))
                for speculating in (False, True)}
            for round_ in range(self.cfg.rounds):
                for dataset in SPECULATION_DATASETS:
                    for speculating, server in servers.items():
                        if server is not None:
                            self.speculation_run(server, dataset, speculating, round_)

    def speculation_run(self, server: Server, dataset: str, speculating: bool,
                        round_: int) -> None:
        """One run at one stream; with speculation, its tokens per verify step too."""
        label = f"speculation-{dataset}-{'ngram' if speculating else 'none'}-r{round_ + 1}"
        before = verify_counts(server) if speculating else (0, 0)
        self.res.speculation.setdefault((dataset, speculating), []).append(serving_run(
            label, server, self.results, *speculation_args(self.cfg, dataset, round_)))
        if speculating:
            steps, tokens = (a - b for a, b in zip(verify_counts(server), before))
            if steps > 0:
                self.res.accept_lengths.setdefault(dataset, []).append(tokens / steps)

    def phase(self, c: int, llama: tuple[Path, Path] | None) -> None:
        """Every server at concurrency `c`: the head-to-head rounds of the main shape (shoal and
        its bare forward, llama.cpp F32, and at the int8 concurrencies shoal w8a16 and llama.cpp
        Q8_0, in turns), the other shapes once, then transformers."""
        cfg, results = self.cfg, self.results
        work = [w for w in cfg.workloads(cfg.concurrencies) if w[1] == c]
        int8 = c in cfg.int8_concurrencies
        shoal = self.server(lambda: shoal_server(results, SHOAL, *self.kv)) if work else None
        shoal_int8 = self.server(lambda: shoal_server(
            results, SHOAL_INT8, *self.kv, "--quantization", "w8a16")) if int8 else None
        with contextlib.ExitStack() as phase_servers:
            f32 = q8 = None
            if llama is not None and work:
                f32 = self.llama_phase_server(phase_servers, LLAMA_F32, llama[0], c, work)
            if llama is not None and int8:
                q8 = self.llama_phase_server(phase_servers, LLAMA_Q8, llama[1], c,
                                             [(cfg.shape, c)])
            for round_ in range(cfg.rounds):
                if shoal is not None:
                    self.random(SHOAL, shoal, cfg.shape, c, round_)
                    self.res.forward.setdefault(c, []).append(
                        forward_run(f"forward-b{c}-r{round_ + 1}", cfg, c, results))
                if c == 1:
                    self.generate(round_)
                if f32 is not None:
                    self.random(LLAMA_F32, f32, cfg.shape, c, round_)
                if shoal_int8 is not None:
                    self.random(SHOAL_INT8, shoal_int8, cfg.shape, c, round_)
                if q8 is not None:
                    self.random(LLAMA_Q8, q8, cfg.shape, c, round_)
            for shape in (s for s, _ in work if s != cfg.shape):
                if shoal is not None:
                    self.random(SHOAL, shoal, shape, c)
                if f32 is not None:
                    self.random(LLAMA_F32, f32, shape, c)
        if work and not cfg.skip_transformers:
            self.serve(transformers_server(f"{TRANSFORMERS} (concurrency {c})",
                                           str(model_store.prepare()),
                                           cfg.hf_threads(usable_cores()), results),
                       self.randoms(TRANSFORMERS, work))

    def generate(self, round_: int) -> None:
        """transformers `generate` at batch 1 on each thread count, in a round of concurrency 1
        (the single-stream ratio pairs it with shoal's run of that round)."""
        for n in self.cfg.generate_threads(usable_cores()):
            self.res.generate.setdefault(n, []).append(generate_run(
                f"generate-t{n}-r{round_ + 1}", self.cfg, n, round_, self.results))

    def shared_prefixes(self, radix: bool) -> Callable[[Server], None]:
        """Every shared-prefix shape, on a server of its own (its KV pool sized for them)."""
        def body(server: Server) -> None:
            for shape in self.cfg.shared_shapes:
                self.shared_prefix(server, shape, radix)
        return body

    def shared_prefix(self, server: Server, shape: Shape, radix: bool) -> None:
        if radix:
            flushed = httpx.post(server.base_url + "/flush_cache", timeout=60)
            if flushed.status_code != 200:
                self.res.errors.append(f"/flush_cache answered {flushed.status_code}: "
                                       f"{flushed.text}")
        label = f"shoal-shared-prefix-{shape[0]}+{shape[1]}{'' if radix else '-no-radix'}"
        self.res.shared[(radix, shape)] = serving_run(label, server, self.results,
                                                      *shared_prefix_args(self.cfg, shape))

    def llama_ggufs(self) -> tuple[Path, Path] | None:
        """The F32 and Q8_0 GGUFs, converted once; None (and an error) if llama.cpp is absent."""
        if self.llama_bin is None:
            self.res.errors.append("llama.cpp: no --llama-cpp-bin (run tools/llama-cpp/build.sh)")
            return None
        cache = llama_cpp.tools_dir() / "gguf"
        try:
            source = llama_cpp.source_gguf()
            return (llama_cpp.converted_gguf(self.llama_bin, "F32", source, cache),
                    llama_cpp.converted_gguf(self.llama_bin, "Q8_0", source, cache))
        except (OSError, subprocess.CalledProcessError, model_store.ModelNotAvailable) as exc:
            self.res.errors.append(f"llama.cpp GGUF conversion: {exc}")
            return None

    def llama(self, system: str, gguf: Path, concurrency: int, work: list[tuple[Shape, int]],
              threads: int | None = None) -> Server:
        """A `llama-server` for `work` at `concurrency` (`-np`), on `threads` (default: the
        suite's choice)."""
        assert self.llama_bin is not None
        threads = threads or self.llama_threads
        return llama_server(f"{system} -np {concurrency} -t {threads}", self.llama_bin, gguf,
                            concurrency, threads, max(i + o for (i, o), _ in work), self.results,
                            repack=gguf not in self.no_repack)

    def llama_phase_server(self, stack: contextlib.ExitStack, system: str, gguf: Path,
                           concurrency: int, work: list[tuple[Shape, int]]) -> Server | None:
        """`llama` started until `stack` closes; None if it would not start. A build whose
        repacked-weight kernels hit an illegal instruction at load (llama.cpp's AMX Q8_0 kernel
        did on a 2-core Xeon whose AMX runs) is started again with `--no-repack`, and that GGUF
        keeps it for the rest of the run: a note in the report, not a failure, since every
        measurement is still taken (a second death is a failure)."""
        server = self.llama(system, gguf, concurrency, work)
        stack.callback(server.stop)
        exc = self.try_start(server)
        if exc is None:
            return server
        if server.exit_code() != -signal.SIGILL or gguf in self.no_repack:
            self.record_error(server, exc)
            return None
        self.no_repack.add(gguf)
        self.res.notes.append(f"{system}: `llama-server` died on an illegal instruction while "
                              f"loading (log: {server.log_path}); this GGUF's servers run with "
                              f"--no-repack from here on")
        return self.phase_server(stack, self.llama(system, gguf, concurrency, work))

    def llama_trial(self, gguf: Path, concurrency: int, threads: int) -> None:
        """llama.cpp F32 on another thread count, the main shape at `concurrency`."""
        cfg = self.cfg
        work = [(cfg.shape, concurrency)]

        def trial(server: Server) -> None:
            self.res.llama_threads[(threads, concurrency)] = serving_run(
                f"{random_label(LLAMA_F32, cfg.shape, concurrency)}-t{threads}", server,
                self.results, *random_args(cfg, cfg.shape, concurrency))

        self.serve(self.llama(LLAMA_F32, gguf, concurrency, work, threads), trial)


# -- command line ---------------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


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
    parser.add_argument("--rounds", type=_positive, default=None,
                        help="head-to-head rounds per concurrency (default 3; --quick 2)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--transformers-threads", type=int, default=None,
                        help="OMP_NUM_THREADS of transformers serve (default: as many torch "
                             "threads as shoal's scheduler gets)")
    parser.add_argument("--llama-cpp-bin", default=None,
                        help="folder with llama-server and llama-quantize (what "
                             "tools/llama-cpp/build.sh prints)")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--llama-cpp-threads", type=int, default=None,
                        help="llama-server -t (default: cores - 1, as shoal's decode; -tb is "
                             "every core)")
    parser.add_argument("--docs-dir", default=None,
                        help="where benchmarks.md and the plot go (default: docs/, or the "
                             "results folder with --quick)")
    parser.add_argument("--results-dir", default="build/bench",
                        help="raw JSON results and server logs")
    return parser


def config_from_args(ns: argparse.Namespace) -> SuiteConfig:
    cfg = SuiteConfig(**QUICK) if ns.quick else SuiteConfig()
    overrides: dict[str, Any] = {}
    if ns.concurrencies:
        overrides["concurrencies"] = tuple(int(c) for c in ns.concurrencies.split(","))
    for name in ("input_len", "output_len", "waves", "shared_num_prompts", "rounds",
                 "transformers_threads", "llama_cpp_threads"):
        if getattr(ns, name) is not None:
            overrides[name] = getattr(ns, name)
    for name in ("skip_transformers", "skip_llama_cpp"):
        if getattr(ns, name):
            overrides[name] = True
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
    load_before = os.getloadavg()

    def report(res: SuiteResults, done: bool) -> None:
        """docs/benchmarks.md and the plot from what has run so far (rewritten after each
        server, so that a run cut short still leaves its numbers)."""
        wall_s = time.monotonic() - start
        info = {**machine, "load average (1/5/15 min) before / after": (
            f"{' '.join(f'{x:.2f}' for x in load_before)} / "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
            + ("" if done else " (run still in progress)"))}
        (results / "suite.json").write_text(json.dumps(
            {"config": dataclasses.asdict(cfg), "machine": info, "wall_s": wall_s,
             "done": done, "servers": res.servers, "errors": res.errors, "notes": res.notes},
            indent=2) + "\n")
        write_report(cfg, res, info, wall_s, docs / "benchmarks.md",
                     docs / "benchmarks_throughput.png")
        plot_throughput(cfg, res, docs / "benchmarks_throughput.png")

    llama_bin = Path(ns.llama_cpp_bin) if ns.llama_cpp_bin else None
    res = Suite(cfg, results, llama_bin, lambda r: report(r, done=False)).run()
    report(res, done=True)
    wall_s = time.monotonic() - start
    print(f"[suite] done in {wall_s / 60:.1f} min; wrote {docs / 'benchmarks.md'} and "
          f"{docs / 'benchmarks_throughput.png'}; raw results in {results}", file=sys.stderr)
    for crit in acceptance(cfg, res):
        print(f"[suite] {crit.verdict:4} {crit.name}: {crit.measured}", file=sys.stderr)
    for note in res.notes:
        print(f"[suite] note: {note}", file=sys.stderr)
    failed = res.errors or any(not r.ok for r in res.all_runs())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
