"""benchmarks/eos_acceptance.py: drafted rounds split at the output's first EOS."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from dspark.engine.request import RoundStats

_spec = importlib.util.spec_from_file_location(
    "eos_acceptance", Path(__file__).resolve().parent.parent / "benchmarks" / "eos_acceptance.py")
eos_acceptance = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eos_acceptance)


def test_rounds_split_at_the_first_eos() -> None:
    tokens = [5, 6, 2, 7, 8, 2, 10, 11]  # EOS (2) first at position 2
    rounds = [RoundStats(0, 0),  # prefill: commits position 0
              RoundStats(3, 2),  # starts at 1, commits 1-3 (the EOS among them): before
              RoundStats(3, 0),  # starts at 4: after
              RoundStats(0, 0),  # no drafts: counted nowhere
              RoundStats(2, 1)]  # starts at 6: after
    assert eos_acceptance.split_rounds(tokens, rounds, {2}) == ([2], [0, 1])
    assert eos_acceptance.split_rounds(tokens, rounds, {99}) == ([2, 0, 1], [])  # no EOS: every round before
