"""The linear kernels chosen on this host, kept on disk so that later loads skip measuring them.

Timing every candidate for each weight shape takes a few seconds of every rank's start
(`shoal.kernels.linear_kernels`), and two loads of one model may choose differently within this
host's noise. The choice depends on the host and the software, so it is kept under a key that
names both: the CPU (model name and instruction-set flags), the logical CPU count, the versions
of torch, numpy and numba, a digest of shoal's own kernel sources (an upgrade that changes a
kernel measures again), the candidates that ran here, the row counts they were timed at,
the quantization, the weight shape and the thread counts. The file is `kernel-choices.json` in
shoal's cache directory (`SHOAL_CACHE_DIR`); delete it to measure again. Where it cannot be read
or written, every load measures.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import tempfile
from pathlib import Path

import numba
import numpy as np
import torch

from shoal.cpu_cores import usable_cores
from shoal.model_store import shoal_cache_dir

logger = logging.getLogger(__name__)

FILE_NAME = "kernel-choices.json"

# (layout, kernel name per row bucket), as `linear_kernels.Choice` holds them
Entry = tuple[str, tuple[str, ...]]


# shoal's modules whose code the timed kernels are (or run them)
KERNEL_MODULES = ("shoal.kernels.linear_kernels", "shoal.kernels.numba_products",
                  "shoal.kernels.panel_products", "shoal.kernels.vector_ir",
                  "shoal.kernels.numba_kernels")


def sources_digest(modules: tuple[str, ...]) -> str:
    """sha256 of the source files of `modules`, in order."""
    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        digest.update(Path(spec.origin).read_bytes())
    return digest.hexdigest()


@functools.cache
def _host() -> str:
    """The CPU model and flags (Linux's /proc/cpuinfo, else the platform's name for it), the
    logical CPU count, the versions of the libraries whose kernels are timed and the digest of
    shoal's kernel sources."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            fields = {name.strip(): value.strip()
                      for name, value in (line.split(":", 1) for line in info if ":" in line)}
        cpu = f"{fields.get('model name', cpu)} {fields.get('flags', '')}"
    except OSError:
        pass
    return json.dumps([cpu, usable_cores(), torch.__version__, np.__version__,
                       numba.__version__, sources_digest(KERNEL_MODULES)])


def key(quantization: bool, shape: tuple[int, int], threads: tuple[int, ...],
        candidates: tuple[str, ...], timed_rows: tuple[tuple[int, ...], ...]) -> str:
    """The entry's name for one weight shape's choice on this host."""
    text = json.dumps([_host(), quantization, list(shape), list(threads), list(candidates),
                       [list(rows) for rows in timed_rows]])
    return hashlib.sha256(text.encode()).hexdigest()


def _path() -> Path:
    return shoal_cache_dir() / FILE_NAME


def _read() -> dict[str, list]:
    try:
        entries = json.loads(_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def load(name: str) -> Entry | None:
    """The choice kept under `name`, if any (a malformed entry counts as none)."""
    entry = _read().get(name)
    if (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
            and isinstance(entry[1], list) and all(isinstance(k, str) for k in entry[1])):
        return entry[0], tuple(entry[1])
    return None


def store(name: str, entry: Entry) -> None:
    """Keep `entry` under `name` (written whole and renamed into place: a concurrent writer may
    drop it, and it is measured again then)."""
    entries = _read()
    entries[name] = [entry[0], list(entry[1])]
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=FILE_NAME)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump(entries, out)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    except OSError as error:
        logger.info("linear kernel choices not kept (%s): the next load measures again", error)
