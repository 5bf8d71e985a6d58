"""What a `make bench` run is made of: its configuration, each subprocess benchmark (`Run`) and
the collected results; `suite.py` produces them, `acceptance.py` and `report.py` read them."""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Shape = tuple[int, int]  # (prompt tokens, output tokens) of the random dataset

# the servers measured, as the tables name them
SHOAL = "shoal"
SHOAL_INT8 = "shoal w8a16"
TRANSFORMERS = "transformers serve CB"
LLAMA_F32 = "llama.cpp F32"
LLAMA_Q8 = "llama.cpp Q8_0"
SYSTEMS = (SHOAL, SHOAL_INT8, LLAMA_F32, LLAMA_Q8, TRANSFORMERS)
# speculative decoding's runs: a text the answer repeats (editing, summarizing), random text
SPECULATION_DATASETS = ("repeat", "random")


@dataclass(frozen=True)
class SuiteConfig:
    """The full run takes ~50 minutes on 2 cores (49 on 2026-12-05, three rounds; shoal at
    concurrency 64 ~30 s a round, transformers serve ~235 s; the shared prefix without the radix
    cache prefills 64 x 1056 tokens, ~2.5 min, and 64 x 2080, ~5 min). Output >> input keeps
    the main random workload decode-bound, which is what the bare-forward ceiling measures;
    `extra_shapes` are measured at `ratio_concurrency` only."""

    concurrencies: tuple[int, ...] = (1, 4, 16, 32, 64)
    input_len: int = 64
    output_len: int = 128
    extra_shapes: tuple[Shape, ...] = ((150, 64), (512, 32))
    int8_concurrencies: tuple[int, ...] = (1, 16, 32)
    min_prompts: int = 4           # num_prompts at concurrency c = max(min_prompts, c * waves)
    waves: int = 1
    # (prefix, suffix) tokens; the criterion asks for a 4x TTFT on more than one of them
    shared_shapes: tuple[Shape, ...] = ((2048, 32), (1024, 32), (512, 64))
    shared_num_prompts: int = 64
    shared_output_len: int = 16
    shared_concurrency: int = 16
    generate_repeats: int = 2
    # speculative decoding (`--speculative-algorithm ngram` against none) at one stream, greedy:
    # (prompt tokens, output tokens) of each dataset's requests, and requests per run
    speculation_shape: Shape = (256, 128)
    speculation_num_prompts: int = 4
    ratio_concurrency: int = 32    # the shape comparisons and the ceiling are read here
    # head-to-head rounds per concurrency (`rounds` in SuiteResults): the runs a ratio compares
    # are repeated in turns, seconds apart, and each ratio is the median of its rounds' ratios,
    # since what this shared host gives moves 30-50% between minutes
    rounds: int = 3
    seed: int = 0
    skip_transformers: bool = False
    transformers_threads: int | None = None  # None: cores - 1 (its fastest on 2 cores)
    skip_llama_cpp: bool = False
    llama_cpp_threads: int | None = None  # -t; None: one per core, as llama.cpp's docs advise
    # other -t values, tried at concurrency 1 and ratio_concurrency; None: cores - 1
    llama_cpp_thread_trials: tuple[int, ...] | None = None
    quick: bool = False

    def hf_threads(self, cores: int) -> int:
        """OMP_NUM_THREADS of `transformers serve`: on 2 cores its default of one thread per core
        ran ~5x slower next to its own HTTP thread and the benchmark client."""
        return self.transformers_threads or max(1, cores - 1)

    def generate_threads(self, cores: int) -> list[int]:
        """Thread counts transformers' `generate` runs with; the report keeps the best."""
        return sorted({max(1, cores - 1), cores})

    def llama_threads(self, cores: int) -> int:
        """`llama-server -t` (generation threads) and `-tb` (prompt processing, always every
        core): one per core, as llama.cpp's docs advise and as shoal's forward runs on CPU."""
        return self.llama_cpp_threads or cores

    def llama_thread_trials(self, cores: int) -> list[int]:
        trials = self.llama_cpp_thread_trials or (max(1, cores - 1),)
        return [t for t in trials if t != self.llama_threads(cores)]

    @property
    def shape(self) -> Shape:
        return (self.input_len, self.output_len)

    @property
    def shapes(self) -> tuple[Shape, ...]:
        return (self.shape, *(s for s in self.extra_shapes if s != self.shape))

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, concurrency * self.waves)

    def workloads(self, concurrencies: tuple[int, ...]) -> list[tuple[Shape, int]]:
        """(shape, concurrency) pairs a server runs: the main shape at each of `concurrencies`,
        the extra shapes at `ratio_concurrency` when it is one of them."""
        runs = [(self.shape, c) for c in concurrencies]
        if self.ratio_concurrency in concurrencies:
            runs += [(s, self.ratio_concurrency) for s in self.shapes[1:]]
        return runs

    @property
    def kv_tokens(self) -> int:
        """`--max-total-tokens` of the shoal servers of the random workloads: twice what the
        largest workload holds at once, in steps of 4,096 (by default shoal sizes its KV pool
        from free memory: ~100k tokens, 4.7 GB here, while three servers share 24 GB with other
        work)."""
        return _twice_in_pages(max(c * (i + o) for (i, o), c in
                                   self.workloads(self.concurrencies)))

    @property
    def shared_kv_tokens(self) -> int:
        """`--max-total-tokens` of the shared-prefix servers, which run alone after the other
        servers have stopped: twice the largest shape's requests in flight and its prefix."""
        return _twice_in_pages(max(self.shared_concurrency * (p + s + self.shared_output_len) + p
                                   for p, s in self.shared_shapes))

    def phase_order(self) -> list[int]:
        """Concurrencies in the order the suite measures them: 1 and the ratio concurrency
        first, then the int8 ones, then the rest from the highest."""
        def key(c: int) -> tuple[bool, bool, bool, int]:
            return (c != 1, c != self.ratio_concurrency, c not in self.int8_concurrencies, -c)
        return sorted(set(self.concurrencies) | set(self.int8_concurrencies), key=key)

    def seed_for(self, shape: Shape, concurrency: int, round_: int = 0) -> int:
        """A seed per workload and round: with one seed a run would resend the start of
        another run's prompts, and a prefix cache (shoal's radix cache, llama.cpp's slots) would
        skip their prefill."""
        return (self.seed + concurrency + (0 if shape == self.shape else 1000 * shape[0])
                + 1_000_000 * round_)


def _twice_in_pages(tokens: int) -> int:
    return -(-2 * tokens // 4096) * 4096


QUICK: dict[str, Any] = {
    "concurrencies": (1, 4, 32), "input_len": 32, "output_len": 16,
    "extra_shapes": ((48, 8), (128, 4)), "int8_concurrencies": (1, 4), "min_prompts": 2,
    "shared_shapes": ((256, 16), (128, 32)), "shared_num_prompts": 16, "shared_output_len": 4,
    "shared_concurrency": 4, "generate_repeats": 1, "rounds": 2,
    "speculation_shape": (64, 16), "speculation_num_prompts": 2,
    "quick": True}


def display_argv(argv: list[str]) -> list[str]:
    """`python -m shoal ...` as the user types it: `shoal ...`."""
    if Path(argv[0]).name.startswith("python") and argv[1:2] == ["-m"]:
        return ["shoal", *argv[3:]] if argv[2:3] == ["shoal"] else ["python", *argv[1:]]
    return [Path(argv[0]).name, *argv[1:]]


@dataclass
class Run:
    """One subprocess benchmark: its command line and its JSON output (None if it failed)."""
    label: str
    argv: list[str]
    output_file: Path
    returncode: int | None = None
    data: dict[str, Any] | None = None
    started: float = 0.0
    seconds: float = 0.0

    def execute(self) -> Run:
        print(f"[suite] {self.label}: {self.command()}", file=sys.stderr, flush=True)
        self.started = time.monotonic()
        self.returncode = subprocess.run(self.argv, check=False).returncode
        self.seconds = time.monotonic() - self.started
        if self.output_file.exists():
            self.data = json.loads(self.output_file.read_text())
        if self.returncode != 0:
            print(f"[suite] {self.label} FAILED (exit {self.returncode})", file=sys.stderr)
        return self

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.data is not None

    @property
    def result(self) -> dict[str, Any] | None:
        """The `result` object of a clean `shoal bench serving|forward` run."""
        return self.data["result"] if self.ok and self.data else None

    def command(self) -> str:
        return shlex.join(display_argv(self.argv))


def output_throughput(run: Run) -> float | None:
    r = run.result
    return None if r is None else float(r["output_throughput"])


def median_run(runs: list[Run], value: Callable[[Run], float | None] = output_throughput
               ) -> Run | None:
    """The clean run of median `value` (the lower middle one of an even count), else the first
    run (failed), or None."""
    done = sorted((v, i) for i, run in enumerate(runs) if (v := value(run)) is not None)
    if not done:
        return runs[0] if runs else None
    return runs[done[(len(done) - 1) // 2][1]]


@dataclass
class SuiteResults:
    # (system, shape, concurrency) -> serving runs of the random dataset, one per round (the
    # main shape at every concurrency; other shapes once)
    serving: dict[tuple[str, Shape, int], list[Run]] = dataclasses.field(default_factory=dict)
    # llama.cpp F32 at other thread counts: (threads, concurrency) -> serving run, main shape
    llama_threads: dict[tuple[int, int], Run] = dataclasses.field(default_factory=dict)
    # concurrency -> bare-forward runs at batch = concurrency, one right after each of shoal's
    # rounds
    forward: dict[int, list[Run]] = dataclasses.field(default_factory=dict)
    # threads -> transformers `generate` runs at batch 1, one per round of concurrency 1
    generate: dict[int, list[Run]] = dataclasses.field(default_factory=dict)
    # (radix on?, (prefix, suffix)) -> serving run of the shared-prefix dataset
    shared: dict[tuple[bool, Shape], Run] = dataclasses.field(default_factory=dict)
    # (dataset, speculating?) -> serving runs at one stream, one per round
    speculation: dict[tuple[str, bool], list[Run]] = dataclasses.field(default_factory=dict)
    # dataset -> the ngram server's tokens per verify step over each of its runs
    accept_lengths: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    servers: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> command
    errors: list[str] = dataclasses.field(default_factory=list)
    # what the run worked around and went on with, nothing lost (a peer's flag changed)
    notes: list[str] = dataclasses.field(default_factory=list)

    def rounds(self, system: str, concurrency: int, shape: Shape) -> list[Run]:
        return self.serving.get((system, shape, concurrency), [])

    def get(self, system: str, concurrency: int, shape: Shape) -> Run | None:
        """The run the tables show: the round of median throughput."""
        return median_run(self.rounds(system, concurrency, shape))

    def all_runs(self) -> list[Run]:
        runs = [*(r for rounds in self.forward.values() for r in rounds),
                *(r for rounds in self.generate.values() for r in rounds), *self.serving_runs()]
        return sorted(runs, key=lambda r: r.started)

    def serving_runs(self) -> list[Run]:
        return [*(r for rounds in self.serving.values() for r in rounds),
                *self.llama_threads.values(), *self.shared.values(),
                *(r for rounds in self.speculation.values() for r in rounds)]
