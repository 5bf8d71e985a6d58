"""`make bench`: shoal vs `transformers serve --continuous-batching` vs the bare-forward ceiling.

One run on one machine, the same workload for everyone:
    1. transformers `generate` at batch 1 (best of 1 thread and all cores);
    2. `shoal serve`: at each concurrency c, the random dataset between two runs of
       `shoal bench forward` at batch c (the server up and idle); then the shared-prefix
       dataset. The ceiling is the mean of the runs just before and just after the serving run
       it is compared with: what this shared 2-core host gives drifts by 10-30% within minutes;
    3. `shoal serve --disable-radix-cache`: the shared-prefix dataset;
    4. `transformers serve --continuous-batching`: the random dataset at each concurrency.
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
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from shoal import model_store
from shoal.bench.report import machine_info, plot_throughput, write_report
from shoal.bench.suite_runs import QUICK, Run, SuiteConfig, SuiteResults, display_argv
from shoal.engine.threads import torch_threads_per_rank
from shoal.ports import free_port

STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0


# -- processes ------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]
    base_url: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        with open(self.log_path, "wb") as log:
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
        return (env + " " if env else "") + shlex.join(display_argv(self.argv))


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
            "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)]
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    return Server("transformers", argv, env, f"http://127.0.0.1:{port}",
                  log_dir / "transformers.log")


def serving_run(label: str, server: Server, results: Path, *args: str) -> Run:
    out = results / f"serving-{label}.json"
    argv = [sys.executable, "-m", "shoal", "bench", "serving", "--base-url", server.base_url,
            *args, "--output-file", str(out)]
    return Run(label, argv, out).execute()


def forward_run(label: str, cfg: SuiteConfig, batch_size: int, results: Path) -> Run:
    out = results / f"{label}.json"
    return Run(label, [sys.executable, "-m", "shoal", "bench", "forward", "--batch-size",
                       str(batch_size), "--context-len", str(cfg.forward_context_len),
                       "--steps", str(cfg.forward_steps), "--output-file", str(out)],
               out).execute()


def random_args(cfg: SuiteConfig, concurrency: int) -> list[str]:
    # NOTE: a seed per concurrency: with one seed, each run would resend the previous run's
    # prompts and a prefix cache would skip their prefill.
    return ["--dataset", "random", "--num-prompts", str(cfg.num_prompts(concurrency)),
            "--input-len", str(cfg.input_len), "--output-len", str(cfg.output_len),
            "--max-concurrency", str(concurrency), "--seed", str(cfg.seed + concurrency)]


def shared_prefix_args(cfg: SuiteConfig) -> list[str]:
    return ["--dataset", "shared-prefix", "--num-prompts", str(cfg.shared_num_prompts),
            "--prefix-len", str(cfg.prefix_len), "--suffix-len", str(cfg.suffix_len),
            "--output-len", str(cfg.shared_output_len), "--max-concurrency",
            str(cfg.shared_concurrency), "--seed", str(cfg.seed)]


# -- the run --------------------------------------------------------------------------------


def run_suite(cfg: SuiteConfig, results: Path) -> SuiteResults:
    model_path = str(model_store.prepare())
    threads = torch_threads_per_rank(os.cpu_count() or 1, 1)
    res = SuiteResults()
    for n in sorted({threads, os.cpu_count() or 1}):
        out = results / f"generate-t{n}.json"
        res.generate.append(Run(f"generate-t{n}", [
            sys.executable, "-m", "shoal.bench.hf_generate", "--input-len", str(cfg.input_len),
            "--output-len", str(cfg.output_len), "--num-threads", str(n),
            "--repeats", str(cfg.generate_repeats), "--seed", str(cfg.seed),
            "--output-file", str(out)], out).execute())

    def serve(server: Server, body: Callable[[Server], None]) -> None:
        res.servers[server.name] = server.command()
        try:
            server.start()
            body(server)
        except (RuntimeError, OSError, httpx.HTTPError) as exc:
            res.errors.append(f"{server.name}: {type(exc).__name__}: {exc}")
            print(f"[suite] {exc}", file=sys.stderr)
        finally:
            server.stop()

    def shoal_body(server: Server) -> None:
        for c in cfg.concurrencies:
            res.forward[c] = [forward_run(f"forward-b{c}-before", cfg, c, results)]
            res.shoal[c] = serving_run(f"shoal-c{c}", server, results, *random_args(cfg, c))
            res.forward[c].append(forward_run(f"forward-b{c}-after", cfg, c, results))
        flushed = httpx.post(server.base_url + "/flush_cache", timeout=60)
        if flushed.status_code != 200:
            res.errors.append(f"/flush_cache answered {flushed.status_code}: {flushed.text}")
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
        serve(transformers_server(model_path, cfg.transformers_threads or threads, results),
              transformers_body)
    return res


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
    parser.add_argument("--transformers-threads", type=int, default=None,
                        help="OMP_NUM_THREADS of transformers serve (default: as many torch "
                             "threads as shoal's scheduler gets)")
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
    for name in ("input_len", "output_len", "waves", "shared_num_prompts", "prefix_len",
                 "transformers_threads"):
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
    plot_throughput(cfg, res, docs / "benchmarks_throughput.png")
    print(f"[suite] done in {wall_s / 60:.1f} min; wrote {docs / 'benchmarks.md'} and "
          f"{docs / 'benchmarks_throughput.png'}; raw results in {results}", file=sys.stderr)
    for crit in criteria:
        print(f"[suite] {crit.verdict:4} {crit.name}: {crit.measured}", file=sys.stderr)
    failed = res.errors or any(not r.ok for r in res.all_runs())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
