"""benchmarks/context_slope.py: per-width slot slopes of target passes, and their split per row and per token."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "context_slope", Path(__file__).resolve().parent.parent / "benchmarks" / "context_slope.py")
context_slope = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(context_slope)


def _rounds(r: float, t: float, fixed: float, rows: int = 64):
    """Rounds of widths 1, 2 and 4 over 200-500 slots whose target seconds are fixed + rows·S·(r + t·w)."""
    return [(rows, rows * w, slots, fixed + rows * slots * (r + t * w))
            for w in (1, 2, 4) for slots in range(200, 501, 50)]


def test_slopes_and_split_recover_the_per_row_and_per_token_costs() -> None:
    r, t = 0.6e-6, 0.15e-6
    slopes = context_slope.fit_slopes(_rounds(r, t, 0.02))
    assert sorted(slopes) == [1, 2, 4]
    for w, (a, b, n) in slopes.items():
        assert n == 7
        assert a == pytest.approx(20.0, rel=1e-6)  # ms at no slots, for 64 rows
        assert b == pytest.approx(64 * (r + t * w) * 1e3, rel=1e-6)
    assert context_slope.split_slope(slopes) == pytest.approx((r, t), rel=1e-6)


def test_rounds_are_brought_to_64_rows_and_small_batches_left_out() -> None:
    rounds = _rounds(1e-6, 0.0, 0.0, rows=32) + [(8, 8, s, 1.0) for s in range(100, 400, 10)]
    slopes = context_slope.fit_slopes(rounds, min_rows=16)
    assert sorted(slopes) == [1, 2, 4]  # the 8-row rounds (which would fit a flat line) are out
    for _, b, _ in slopes.values():
        assert b == pytest.approx(64 * 1e-6 * 1e3, rel=1e-6)  # 32 rows' seconds doubled


def test_widths_without_enough_rounds_or_slots_are_not_fitted() -> None:
    rounds = [(64, 64, 300, 0.03)] * 10 + [(64, 128, s, 0.04) for s in (200, 300)]
    assert context_slope.fit_slopes(rounds) == {}  # one S for width 1, two rounds for width 2
    assert context_slope.split_slope({1: (1.0, 0.05, 9)}) is None
