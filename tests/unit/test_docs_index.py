"""The "where is X" indexes name files and functions that exist: docs/architecture.md and the top
of the scheduler module."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType

from shoal.scheduler import scheduler

REPO = Path(__file__).resolve().parents[2]
SYMBOL = re.compile(r"`(server/shoal/[\w/]+\.py)::([\w.]+)`")
FILE = re.compile(r"`(server/shoal/[\w/]+\.py)`")


def _module(path: str) -> ModuleType:
    return importlib.import_module(path.removeprefix("server/").removesuffix(".py")
                                   .replace("/", "."))


def _resolve(module: ModuleType, dotted: str) -> object:
    found: object = module
    for part in dotted.split("."):
        assert hasattr(found, part), f"{module.__name__}.{dotted} does not exist"
        found = getattr(found, part)
    return found


def test_every_symbol_the_architecture_doc_names_exists() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    symbols = SYMBOL.findall(text)
    assert len(symbols) >= 20, "the index is gone"
    for path, dotted in symbols:
        _resolve(_module(path), dotted)
    for path in FILE.findall(text):
        assert (REPO / path).is_file(), path


def test_every_name_in_the_scheduler_index_exists() -> None:
    doc = scheduler.__doc__ or ""
    index = doc.split("Where is ...")[1].split("\n\n", 2)[1]
    names = re.findall(r"\b[A-Za-z_]\w*(?:\.\w+)+|\b_\w+|\b[A-Z][a-z]\w*", index)
    assert len(names) >= 15, "the index is gone"
    for name in names:
        head, _, rest = name.partition(".")
        if rest and head[0].islower() and not head.startswith("_"):
            _resolve(importlib.import_module(f"shoal.scheduler.{head}"), rest)
        else:
            _resolve(scheduler, name)
