"""The termination message a test's server left behind."""

from __future__ import annotations

from pathlib import Path

from shoal.lifecycle import Termination, parse_termination_message


def termination_message(path: Path) -> Termination:
    """The message in `path` (a test's `SHOAL_TERMINATION_LOG`); fails when there is none."""
    message = parse_termination_message(path.read_text()) if path.exists() else None
    assert message is not None, f"no termination message in {path}"
    return message
