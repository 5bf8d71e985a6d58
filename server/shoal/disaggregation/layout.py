"""What a prefill server announces to the decode servers it feeds, and whether a decode server
can take its KV: the same model and dtype; each side splits it its own way (--tp, --pp), and
`kv_map.transfer_plan` maps one split onto the other. Pure, but for the host name lookup of
`advertised_host`."""

from __future__ import annotations

import hashlib
import json
import socket
from dataclasses import asdict

from shoal.disaggregation.kv_map import transfer_plan
from shoal.disaggregation.messages import PrefillLayout, ServerLayout
from shoal.model_config import ModelConfig

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def server_layout(model: str, config: ModelConfig, dtype: str, tp: int, pp: int) -> ServerLayout:
    return ServerLayout(model=model, fingerprint=model_fingerprint(config), dtype=dtype,
                        num_layers=config.num_layers, num_heads=config.num_heads,
                        num_kv_heads=config.num_kv_heads, tp=tp, pp=pp)


def describe(layout: ServerLayout) -> str:
    return (f"model {layout.model!r} (config {layout.fingerprint}, {layout.dtype}, "
            f"tp={layout.tp}, pp={layout.pp})")


def model_fingerprint(config: ModelConfig) -> str:
    """A short hash of everything about the model that shapes its KV cache and its outputs."""
    text = json.dumps(asdict(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def layout_of(server: ServerLayout, session: str, endpoints: list[str]) -> PrefillLayout:
    return PrefillLayout(session=session, server=server, endpoints=endpoints)


def incompatibility(prefill: ServerLayout, decode: ServerLayout, address: str) -> str | None:
    """Why a decode server with layout `decode` cannot take KV from the prefill server at
    `address`; None when it can."""
    same = ("model", "fingerprint", "dtype", "num_layers", "num_heads", "num_kv_heads")
    both = (f"the prefill server at {address} serves {describe(prefill)} but this decode server "
            f"serves {describe(decode)}")
    if any(getattr(prefill, f) != getattr(decode, f) for f in same):
        return f"{both}: prefill and decode must serve the same model with the same dtype"
    try:
        transfer_plan(prefill, decode)
    except ValueError as exc:
        return f"{both}: the KV cannot be mapped from one to the other ({exc})"
    return None


def advertised_host(host: str) -> str:
    """The address peers reach this server at: `--host`, or this machine's name when it binds
    every interface."""
    if host not in WILDCARD_HOSTS:
        return host
    return socket.gethostbyname(socket.gethostname())
