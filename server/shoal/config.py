"""Server configuration: the `shoal serve` flags, read from argv with `SHOAL_<FLAG>` env fallback.

`ServerArgs` is frozen; every component of one server receives the same flags, so every process
builds an identical `ServerArgs`. Per-process facts (which rank, which run directory) travel
separately in `ComponentArgs`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

DEFAULT_PORT = 30000
DEFAULT_BOOTSTRAP_PORT = 8998

Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["none", "w8a16"]  # w8a16: int8 weights per output channel
# auto: the CPU kernels where they run and agree with torch; torch: plain torch everywhere
CpuKernels = Literal["auto", "torch"]
SchedulePolicy = Literal["fcfs", "lpm"]
DisaggregationMode = Literal["null", "prefill", "decode"]


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    tp: int = 1
    pp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    device: Device = "auto"
    dtype: Dtype = "auto"
    quantization: Quantization = "none"
    cpu_kernels: CpuKernels = "auto"  # shoal.kernels.prepare
    context_length: int | None = None
    max_running_requests: int | None = None
    max_queued_requests: int | None = None  # None: unbounded (api/backpressure.py)
    max_total_tokens: int | None = None
    page_size: int = 1
    chunked_prefill_size: int | None = None  # None: by device (scheduler/process.py)
    schedule_policy: SchedulePolicy = "fcfs"
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    enable_overlap_schedule: bool = False  # on CPU too, where it is off by default
    # speculative decoding (scheduler/speculation.py): "ngram" (case-insensitive) or None
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4  # most tokens proposed per request and step
    watchdog_timeout: float = 300.0
    enable_rank_consensus_check: bool = False
    disaggregation_mode: DisaggregationMode = "null"  # null: a colocated server (docs/pd.md)
    disaggregation_bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT  # a prefill's rank 0 serves it
    disaggregation_timeout: float = 300.0  # seconds a request may wait on its peer server
    api_key: str | None = None
    enable_metrics: bool = False
    log_level: str = "info"

    def __post_init__(self) -> None:
        checks = [
            (self.tp >= 1, "--tp must be >= 1"),
            (self.pp >= 1, "--pp must be >= 1"),
            (self.nnodes >= 1, "--nnodes must be >= 1"),
            (0 <= self.node_rank < self.nnodes, "--node-rank must be in [0, --nnodes)"),
            ((self.tp * self.pp) % self.nnodes == 0, "--tp x --pp must be divisible by --nnodes"),
            (self.nnodes == 1 or self.dist_init_addr is not None,
             "--dist-init-addr is required when --nnodes > 1"),
            (self.page_size == 1, "--page-size: only 1 is supported by the torch attention "
                                  "backend (the KV pool is paged per token)"),
            (self.chunked_prefill_size is None or self.chunked_prefill_size >= 1,
             "--chunked-prefill-size must be >= 1"),
            (self.watchdog_timeout > 0, "--watchdog-timeout must be > 0"),
            (not (self.enable_overlap_schedule and self.disable_overlap_schedule),
             "--enable-overlap-schedule and --disable-overlap-schedule contradict each other"),
            (not self.enable_overlap_schedule or self.tp * self.pp == 1,
             f"--enable-overlap-schedule: the overlap loop runs on a single-rank server only "
             f"(--tp 1 --pp 1); this one has --tp {self.tp} --pp {self.pp}"),
            (1 <= self.port <= 65535, "--port must be in [1, 65535]"),
            (self.context_length is None or self.context_length >= 2,
             "--context-length must be >= 2"),
            (self.max_total_tokens is None or self.max_total_tokens >= 16,
             "--max-total-tokens must be >= 16"),
            (self.max_running_requests is None or self.max_running_requests >= 1,
             "--max-running-requests must be >= 1"),
            (self.max_queued_requests is None or self.max_queued_requests >= 0,
             "--max-queued-requests must be >= 0"),
            (1 <= self.disaggregation_bootstrap_port <= 65535,
             "--disaggregation-bootstrap-port must be in [1, 65535]"),
            (self.disaggregation_timeout > 0, "--disaggregation-timeout must be > 0"),
            *self._speculation_checks(),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def _speculation_checks(self) -> list[tuple[bool, str]]:
        if self.speculative_algorithm is None:
            return []
        algorithm = self.speculative_algorithm.lower()
        return [
            (algorithm != "draft", "--speculative-algorithm draft (a draft model) is not "
                                   "implemented yet; use ngram (prompt lookup)"),
            (algorithm in ("draft", "ngram"),
             f"--speculative-algorithm: unknown {self.speculative_algorithm!r}; known: ngram"),
            (self.speculative_num_draft_tokens >= 1,
             "--speculative-num-draft-tokens must be >= 1"),
            (self.tp * self.pp == 1, "--speculative-algorithm runs on one rank only: "
                                     "--tp 1 --pp 1 (--tp, --pp)"),
            (self.disaggregation_mode != "prefill", "--speculative-algorithm speeds up decoding: "
                                                    "give it to the decode servers, not to "
                                                    "--disaggregation-mode prefill"),
            (not self.enable_overlap_schedule, "--speculative-algorithm runs the plain loop: "
                                               "drop --enable-overlap-schedule"),
        ]

    @property
    def speculation(self) -> str | None:
        """The speculative decoding algorithm, lower case; None: off."""
        return None if self.speculative_algorithm is None else self.speculative_algorithm.lower()

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def use_overlap_schedule(self, device_type: str) -> bool:
        """The overlap loop: single-rank servers without speculative decoding only (asking for
        it with more ranks is refused at startup); by default on CUDA, not on CPU, where the
        forward runs on every core and the loop's worker thread slows it down
        (docs/architecture.md, "The overlap loop")."""
        if self.world_size != 1 or self.disable_overlap_schedule or self.speculation:
            return False
        return self.enable_overlap_schedule or device_type != "cpu"

    def local_ranks(self) -> list[tuple[int, int]]:
        """(pp_rank, tp_rank) of the ranks this node runs; global rank = pp_rank * tp + tp_rank."""
        first = self.node_rank * self.ranks_per_node
        return [divmod(rank, self.tp) for rank in range(first, first + self.ranks_per_node)]


@dataclass(frozen=True)
class ComponentArgs:
    """What one process adds to the shared `ServerArgs`: its rank and run directory."""

    run_dir: str
    pp_rank: int = 0
    tp_rank: int = 0

    def global_rank(self, args: ServerArgs) -> int:
        """This scheduler's rank in the server: pp_rank * tp + tp_rank."""
        return self.pp_rank * args.tp + self.tp_rank

    def scheduler_name(self, args: ServerArgs) -> str:
        return scheduler_name(self.pp_rank, self.tp_rank, args.pp)


def scheduler_name(pp_rank: int, tp_rank: int, pp_size: int) -> str:
    """A scheduler's component name; its process title is `shoal::<name>`."""
    return f"scheduler_PP{pp_rank}_TP{tp_rank}" if pp_size > 1 else f"scheduler_TP{tp_rank}"


class ConfigError(ValueError):
    """A flag value that cannot work; the server refuses to start (exit 88)."""


@dataclass(frozen=True)
class _Flag:
    name: str
    kind: type                          # how a value is parsed: bool, int, float or str
    choices: tuple[str, ...] | None     # a Literal's values


def _flag(name: str, annotation: Any) -> _Flag:
    """The flag of a `ServerArgs` field from its type: `X | None` is X, a Literal is a str with
    choices."""
    if isinstance(annotation, types.UnionType):
        (annotation,) = (arg for arg in typing.get_args(annotation) if arg is not type(None))
    if typing.get_origin(annotation) is Literal:
        return _Flag(name, str, typing.get_args(annotation))
    return _Flag(name, annotation, None)


def _flags() -> list[_Flag]:
    hints = typing.get_type_hints(ServerArgs)
    return [_flag(f.name, hints[f.name]) for f in dataclasses.fields(ServerArgs)]


def env_name(field_name: str) -> str:
    return "SHOAL_" + field_name.upper()


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"not a boolean: {text!r}")


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Add every ServerArgs flag; defaults stay None so env fallback can be applied afterwards."""
    for flag in _flags():
        option = "--" + flag.name.replace("_", "-")
        if flag.kind is bool:
            parser.add_argument(option, dest=flag.name, action="store_const", const=True,
                                default=None)
        else:
            parser.add_argument(option, dest=flag.name, type=flag.kind, choices=flag.choices,
                                default=None)


def server_args_from_namespace(ns: argparse.Namespace,
                               environ: dict[str, str] | None = None) -> ServerArgs:
    """Flag wins; otherwise `SHOAL_<FLAG>` from the environment; otherwise the dataclass default."""
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    for flag in _flags():
        value = getattr(ns, flag.name, None)
        if value is None and env_name(flag.name) in environ:
            raw = environ[env_name(flag.name)]
            try:
                value = _parse_bool(raw) if flag.kind is bool else flag.kind(raw)
            except ValueError as exc:
                raise ConfigError(f"{env_name(flag.name)}={raw!r}: {exc}") from exc
            if flag.choices and value not in flag.choices:
                raise ConfigError(f"{env_name(flag.name)}={raw!r}: expected one of {flag.choices}")
        if value is not None:
            values[flag.name] = value
    return ServerArgs(**values)


def to_argv(args: ServerArgs) -> list[str]:
    """The flags that reproduce `args` (only those differing from the defaults)."""
    argv: list[str] = []
    defaults = ServerArgs()
    for flag in _flags():
        value = getattr(args, flag.name)
        if value == getattr(defaults, flag.name):
            continue
        option = "--" + flag.name.replace("_", "-")
        if flag.kind is bool:
            argv.append(option)
        else:
            argv += [option, str(value)]
    return argv
