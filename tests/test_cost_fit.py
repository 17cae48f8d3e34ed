"""Smoothing a profiled cost row: noise is averaged away, real steps and knees are kept."""
from __future__ import annotations

import numpy as np
import pytest

from dspark.cost_fit import chi2_quantile, fit_row
from dspark.scheduling import CostModel, prefix_schedule

NS = np.arange(1, 9)  # a B = 1 row: N = 1 + ℓ, ℓ = 0..7


def repeats(true: np.ndarray, sigma: float, reps: int = 5, seed: int = 0, bump: tuple[int, float] | None = None):
    """{N: [s, ...]}: the true seconds plus normal noise; `bump` (cell index, seconds) adds a stall to 3 of
    that cell's repeats (a burst of machine noise hitting one cell, as in the CPU profiles)."""
    rng = np.random.default_rng(seed)
    out = {int(n): list(t + sigma * rng.standard_normal(reps)) for n, t in zip(NS, true)}
    if bump is not None:
        i, extra = bump
        cell = out[int(NS[i])]
        for j in range(3):
            cell[j] += extra
    return out


def test_chi2_quantile_matches_scipy():
    from scipy.stats import chi2

    for df in (3, 4, 8, 20):
        assert chi2_quantile(df) == pytest.approx(chi2.ppf(0.999, df), rel=0.02)


def test_a_noisy_line_with_a_stalled_cell_is_fitted_as_the_line():
    """The medians of a linear row carry a one-cell bump (three stalled repeats) that reads as a cliff; the fit
    is within a fraction of the noise of the true line everywhere and has no cliff."""
    true = 0.0128 + 0.0002 * NS
    times = repeats(true, sigma=0.0008, bump=(5, 0.004))
    medians = np.array([np.median(times[int(n)]) for n in NS])
    assert medians[5] - medians[4] > 0.002  # the bump: 10x the true step
    row, smoothed = fit_row(times)
    fitted = np.array([s for _, s in row])
    assert smoothed and [n for n, _ in row] == NS.tolist()
    assert np.abs(fitted - true).max() < 0.0006
    assert (np.diff(fitted) >= 0).all() and np.diff(fitted).max() < 0.0008


def test_a_real_step_keeps_the_medians():
    """A jump of 25 standard errors (a kernel switch) is not noise: the row keeps its medians."""
    true = 0.010 + 0.0001 * NS + 0.005 * (NS >= 5)
    times = repeats(true, sigma=0.0002)
    row, smoothed = fit_row(times)
    assert not smoothed
    assert row == [(int(n), float(np.median(times[int(n)]))) for n in NS]


def test_flat_then_linear_and_steep_then_shallow_rows_are_fitted():
    """The roofline's shape (flat while reading the weights, then linear) and a steep first draft then a
    shallower slope are both two lines meeting at a knee: fitted without keeping the noisy medians."""
    for true in (0.02 + 0.001 * np.maximum(0, NS - 4), 0.02 + 0.003 * np.minimum(NS, 2) + 0.0005 * NS):
        row, smoothed = fit_row(repeats(true, sigma=0.0003, seed=3))
        assert smoothed
        assert np.abs(np.array([s for _, s in row]) - true).max() < 0.0004


def test_rows_that_cannot_be_judged_keep_their_medians():
    line = 0.01 + 0.001 * NS
    single = {int(n): [float(t)] for n, t in zip(NS, line)}  # one repeat: no noise estimate
    assert fit_row(single) == ([(int(n), float(t)) for n, t in zip(NS, line)], False)
    exact = {int(n): [float(t)] * 3 for n, t in zip(NS, line)}  # no spread at all
    assert fit_row(exact)[1] is False
    four = {n: [0.01, 0.011] for n in (1, 2, 3, 4)}  # too few cells for a knee and a test
    assert fit_row(four)[1] is False
    with pytest.raises(ValueError, match="at least one timing"):
        fit_row({1: [0.01], 2: []})


def test_the_fitted_row_stops_a_cut_in_front_of_a_noise_cliff():
    """Algorithm 1 on the noisy medians (made non-decreasing by the cost model: flat stretches, then a jump
    where the noise happens to rise) stops short of the block; with the fitted row the same survivals verify
    the whole block, as the true costs say they should."""
    true = 0.0128 + 0.0002 * NS
    times = repeats(true, sigma=0.0008, bump=(5, 0.004))
    medians = [(int(n), float(np.median(times[int(n)]))) for n in NS]
    row, _ = fit_row(times)
    survival = np.cumprod([[0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.55]], axis=1)
    by_medians = prefix_schedule(survival, [7], CostModel({1: medians}, {1: 0.01}))[0]
    by_fit = prefix_schedule(survival, [7], CostModel({1: row}, {1: 0.01}))[0]
    by_truth = prefix_schedule(survival, [7], CostModel({1: list(zip(NS.tolist(), true))}, {1: 0.01}))[0]
    assert by_medians.tolist() == [6] and by_fit.tolist() == by_truth.tolist() == [7]


def test_the_step_test_rarely_rejects_a_smooth_row_and_finds_large_steps():
    """Over many noisy rows: a smooth row keeps its fit nearly always (a stalled cell rarely spoils it), and a
    step of 5 noise standard deviations at one N keeps the medians most of the time."""
    line = 0.0128 + 0.0002 * NS
    smooth = [fit_row(repeats(line, 0.0008, seed=s))[1] for s in range(150)]
    stalled = [fit_row(repeats(line, 0.0008, seed=s, bump=(5, 0.004)))[1] for s in range(150)]
    stepped = [fit_row(repeats(line + 0.004 * (NS >= 5), 0.0008, seed=s))[1] for s in range(150)]
    assert np.mean(smooth) >= 0.95 and np.mean(stalled) >= 0.85 and np.mean(stepped) <= 0.3


def test_profile_rows_are_fitted_from_their_repeats(tmp_path):
    """`profile_steps` and `StepProfile.refitted` build a row from its repeats as `fit_row` does and list the
    rows they smoothed; a row without repeats in the file stays as it is."""
    from dspark.profiling import StepProfile

    noisy = repeats(0.0128 + 0.0002 * NS, 0.0008, bump=(5, 0.004))
    medians = [(n, float(np.median(v))) for n, v in noisy.items()]
    other = [(2 * n, 0.02 + 0.001 * n) for n in NS.tolist()]
    profile = StepProfile(CostModel({1: medians, 2: other}, {1: 0.01, 2: 0.015}), {"target": "t"},
                          {"drafted_times": {"1": {str(n): v for n, v in noisy.items()}}})
    refitted = profile.refitted()
    assert refitted.cost.drafted[1] == fit_row(noisy)[0] != medians
    assert refitted.cost.drafted[2] == other and refitted.meta["smoothed_rows"] == [1]
    assert refitted.cost.plain == profile.cost.plain
