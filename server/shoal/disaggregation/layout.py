"""What a prefill server announces to the decode servers it feeds, and whether a decode server
can take its KV: the same model, dtype and parallel layout (rank r's shard goes to rank r).
Pure, but for the host name lookup of `advertised_host`."""

from __future__ import annotations

import hashlib
import json
import socket
from dataclasses import asdict, dataclass

from shoal.disaggregation.messages import PrefillLayout
from shoal.model_config import ModelConfig

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class LocalModel:
    """This server's side of the check."""

    model: str         # served model name
    fingerprint: str
    dtype: str
    tp: int
    pp: int

    def describe(self) -> str:
        return (f"model {self.model!r} (config {self.fingerprint}, {self.dtype}, tp={self.tp}, "
                f"pp={self.pp})")


def model_fingerprint(config: ModelConfig) -> str:
    """A short hash of everything about the model that shapes its KV cache and its outputs."""
    text = json.dumps(asdict(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def layout_of(local: LocalModel, session: str, endpoints: list[str]) -> PrefillLayout:
    return PrefillLayout(session=session, model=local.model, fingerprint=local.fingerprint,
                         dtype=local.dtype, tp=local.tp, pp=local.pp, endpoints=endpoints)


def incompatibility(layout: PrefillLayout, local: LocalModel, address: str) -> str | None:
    """Why this decode server cannot take KV from the prefill at `address`; None when it can."""
    theirs = LocalModel(layout.model, layout.fingerprint, layout.dtype, layout.tp, layout.pp)
    if theirs == local:
        return None
    return (f"the prefill server at {address} serves {theirs.describe()} but this decode server "
            f"serves {local.describe()}: prefill and decode must serve the same model with the "
            f"same dtype, --tp and --pp")


def advertised_host(host: str) -> str:
    """The address peers reach this server at: `--host`, or this machine's name when it binds
    every interface."""
    if host not in WILDCARD_HOSTS:
        return host
    return socket.gethostbyname(socket.gethostname())
