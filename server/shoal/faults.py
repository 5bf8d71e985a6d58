"""Fault injection for tests and drills, from `SHOAL_FAULT` (ignored unless set), and the
injectors that are not a line at the place they strike (`HangingRunner`).

`SHOAL_FAULT` is a comma-separated list of items `KIND:key=value:key=value`:

    hang_forward:rank=R:after_steps=N         rank R's forward blocks forever after N forwards
    diverge_consensus:rank=R:after_events=N   rank R hashes a corrupted event after N events
    crash:component=NAME:after_s=S            component NAME raises after S seconds
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from shoal.config import ConfigError

FAULT_ENV = "SHOAL_FAULT"
_SCHEMA = {
    "hang_forward": {"rank": int, "after_steps": int},
    "diverge_consensus": {"rank": int, "after_events": int},
    "crash": {"component": str, "after_s": float},
}


@dataclass(frozen=True)
class Fault:
    kind: str
    params: dict[str, int | float | str]


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, *pairs = item.split(":")
        if kind not in _SCHEMA:
            raise ConfigError(f"{FAULT_ENV}: unknown fault {kind!r}; known: {sorted(_SCHEMA)}")
        schema = _SCHEMA[kind]
        params: dict[str, int | float | str] = {}
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key not in schema:
                raise ConfigError(f"{FAULT_ENV}: {kind} takes {sorted(schema)}, not {key!r}")
            try:
                params[key] = schema[key](value)
            except ValueError as exc:
                raise ConfigError(f"{FAULT_ENV}: {item!r}: {exc}") from exc
        missing = set(schema) - set(params)
        if missing:
            raise ConfigError(f"{FAULT_ENV}: {item!r} lacks {sorted(missing)}")
        faults.append(Fault(kind, params))
    return faults


def faults_from_env() -> list[Fault]:
    return parse_faults(os.environ.get(FAULT_ENV, ""))


def hang_forward_after(faults: list[Fault], rank: int) -> int | None:
    return _find(faults, "hang_forward", "rank", rank, "after_steps")  # type: ignore[return-value]


def diverge_consensus_after(faults: list[Fault], rank: int) -> int | None:
    return _find(faults, "diverge_consensus", "rank", rank, "after_events")  # type: ignore[return-value]


def crash_after(faults: list[Fault], component: str) -> float | None:
    return _find(faults, "crash", "component", component, "after_s")  # type: ignore[return-value]


def _find(faults: list[Fault], kind: str, key: str, value: object,
          result: str) -> int | float | str | None:
    for fault in faults:
        if fault.kind == kind and fault.params[key] == value:
            return fault.params[result]
    return None


Batch = TypeVar("Batch", contravariant=True)
Output = TypeVar("Output", covariant=True)


class Forward(Protocol[Batch, Output]):
    def forward(self, batch: Batch) -> Output: ...


class HangingRunner(Generic[Batch, Output]):
    """`hang_forward`: forwards normally `after_steps` times, then blocks forever."""

    def __init__(self, inner: Forward[Batch, Output], after_steps: int) -> None:
        self.inner = inner
        self.remaining = after_steps

    def forward(self, batch: Batch) -> Output:
        if self.remaining <= 0:
            threading.Event().wait()
        self.remaining -= 1
        return self.inner.forward(batch)
