"""What a `make bench` run is made of: its configuration, each subprocess benchmark (`Run`) and
the collected results; `suite.py` produces them, `report.py` reads them."""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SuiteConfig:
    """The full run is sized for 25-30 minutes on 2 cores (measured on a busy machine: shoal at
    concurrency 64 ~95 s, transformers serve ~235 s; the shared prefix without the radix cache
    prefills 128 x 1056 tokens, ~9 min). Output >> input keeps the random workload decode-bound,
    which is what the bare-forward ceiling measures."""

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
    transformers_threads: int | None = None  # None: shoal's policy (cores - 1 on one rank)
    quick: bool = False

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, concurrency * self.waves)

    @property
    def forward_context_len(self) -> int:
        """The mean KV context of a random-dataset request while it decodes."""
        return self.input_len + self.output_len // 2


QUICK: dict[str, Any] = {
    "concurrencies": (1, 4, 32), "input_len": 32, "output_len": 16, "min_prompts": 2,
    "prefix_len": 256, "suffix_len": 16, "shared_num_prompts": 32, "shared_output_len": 4,
    "shared_concurrency": 4, "forward_steps": 4, "generate_repeats": 1, "quick": True}


def display_argv(argv: list[str]) -> list[str]:
    """`python -m shoal ...` as the user types it: `shoal ...`."""
    if argv[1:3] == ["-m", "shoal"]:
        return ["shoal", *argv[3:]]
    if argv[1:2] == ["-m"]:
        return ["python", *argv[1:]]
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

    def command(self) -> str:
        return shlex.join(display_argv(self.argv))


@dataclass
class SuiteResults:
    forward: dict[int, list[Run]] = dataclasses.field(default_factory=dict)  # before, after
    generate: list[Run] = dataclasses.field(default_factory=list)
    shoal: dict[int, Run] = dataclasses.field(default_factory=dict)
    transformers: dict[int, Run] = dataclasses.field(default_factory=dict)
    radix: Run | None = None
    no_radix: Run | None = None
    servers: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> command
    errors: list[str] = dataclasses.field(default_factory=list)

    def all_runs(self) -> list[Run]:
        forward = [r for pair in self.forward.values() for r in pair]
        runs = [*forward, *self.generate, *self.shoal.values(), self.radix,
                self.no_radix, *self.transformers.values()]
        return sorted((r for r in runs if r is not None), key=lambda r: r.started)
