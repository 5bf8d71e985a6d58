"""SHOAL_FAULT parsing."""

from __future__ import annotations

import pytest

from shoal.config import ConfigError
from shoal.faults import crash_after, diverge_consensus_after, hang_forward_after, parse_faults


def test_parses_every_kind() -> None:
    faults = parse_faults("hang_forward:rank=1:after_steps=5, diverge_consensus:rank=0:"
                          "after_events=20,crash:component=detokenizer:after_s=2.5")
    assert hang_forward_after(faults, 1) == 5 and hang_forward_after(faults, 0) is None
    assert diverge_consensus_after(faults, 0) == 20
    assert crash_after(faults, "detokenizer") == 2.5 and crash_after(faults, "api") is None


def test_empty_means_no_faults() -> None:
    assert parse_faults("") == []


@pytest.mark.parametrize("text", ["explode:rank=1", "hang_forward:rank=1",
                                  "hang_forward:rank=x:after_steps=1",
                                  "crash:component=api:after_s=1:color=red"])
def test_bad_fault_specs_are_refused(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_faults(text)
