"""Smoothing one batch size's row of a step-cost profile: seconds against query tokens N, from repeated timings.

A cell's median of a few repeats is noisy on a busy machine. On the 2-core CPU the B = 1 row's medians span
12.4-16.3 ms while its slope is about 0.2 ms per token, and a bump reads to Algorithm 1 as a cost cliff that is
not there: it cuts blocks short in front of it. A step's cost has the roofline's shape, flat while the pass is
bound by reading the weights, then linear in the tokens (or steep for the first draft, then shallower, where
verifying any draft switches to a costlier path), so a row is fitted as two lines meeting at a knee k,

    seconds(N) = a + b1·(min(N, k) − N0) + b2·max(0, N − k),   b1, b2 ≥ 0,

on the cell medians, over every knee k at an interior profiled N, under Huber's loss so that one stalled cell
does not bend it. The fit replaces the medians unless a real step (a kernel or tiling switch) departs from it:
the medians' squared residuals in standard errors (from the repeats' median absolute deviation, pooled over
the row), all but the largest (a real step moves every cell after it, a stall moves one), are summed and
compared with the χ² distribution's 99.9% point; past it the medians stay.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

#: the step test's level, as the standard normal's point: 99.9%
LEVEL_Z = 3.090
#: Huber's constant (in standard errors): 95% efficiency under normal noise
HUBER = 1.345
#: the standard error of a median of n normal draws is this times σ / √n
_MEDIAN_SE = math.sqrt(math.pi / 2)
#: σ of a normal distribution per unit of median absolute deviation
_MAD_SIGMA = 1.4826


def chi2_quantile(df: int, z: float = LEVEL_Z) -> float:
    """The χ²(df) quantile at the standard normal's point z (Wilson-Hilferty; within 2% for df ≥ 3)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def _nonnegative_lstsq(x: np.ndarray, ys: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Fitted values of the weighted least squares of ys on [1, x] with every slope ≥ 0 (the best of the active
    sets; the intercept alone is always one)."""
    best, best_sse = np.full_like(ys, float((w * ys).sum() / w.sum())), math.inf
    root = np.sqrt(w)
    for free in itertools.product((True, False), repeat=x.shape[1]):
        cols = [np.ones_like(ys)] + [x[:, j] for j in range(x.shape[1]) if free[j]]
        design = np.stack(cols, axis=1)
        coef, *_ = np.linalg.lstsq(design * root[:, None], ys * root, rcond=None)
        if (coef[1:] < 0).any():
            continue
        fit = design @ coef
        sse = float((w * (ys - fit) ** 2).sum())
        if sse < best_sse - 1e-15:
            best, best_sse = fit, sse
    return best


def _two_slope_fit(ns: np.ndarray, ys: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least-squares continuous piecewise-linear a + b1·(min(N, k) − N0) + b2·max(0, N − k),
    b1, b2 ≥ 0, over knees k at the interior profiled N (one slope only where that fits best)."""
    best, best_sse = np.full_like(ys, float((w * ys).sum() / w.sum())), math.inf
    for k in ns[1:-1]:
        x = np.stack([np.minimum(ns, k) - ns[0], np.maximum(0.0, ns - k)], axis=1)
        fit = _nonnegative_lstsq(x, ys, w)
        sse = float((w * (ys - fit) ** 2).sum())
        if sse < best_sse - 1e-15:
            best, best_sse = fit, sse
    return best


def robust_fit(ns: np.ndarray, ys: np.ndarray, se: np.ndarray, iterations: int = 20) -> np.ndarray:
    """`_two_slope_fit` under Huber's loss (residuals past HUBER standard errors weigh as their absolute
    value), by iteratively reweighted least squares: one cell's stall does not bend the line."""
    w = 1.0 / se ** 2
    fit = _two_slope_fit(ns, ys, w)
    for _ in range(iterations):
        r = np.abs(ys - fit) / se
        new = _two_slope_fit(ns, ys, w * np.minimum(1.0, HUBER / np.maximum(r, 1e-12)))
        if np.allclose(new, fit, rtol=0, atol=1e-9 * float(np.abs(ys).max())):
            return new
        fit = new
    return fit


def fit_row(times: Mapping[int, Sequence[float]]) -> tuple[list[tuple[int, float]], bool]:
    """A profile row from each cell's repeated step seconds {N: [s, ...]}: ([(N, seconds)], smoothed).

    smoothed is False where the medians are kept: fewer than 5 cells, a cell with fewer than 2 repeats (no
    noise estimate), repeats without spread, or a step the smooth fit does not explain (module doc)."""
    cells = sorted((int(n), np.asarray(v, dtype=np.float64)) for n, v in times.items())
    if not cells or any(len(v) == 0 for _, v in cells):
        raise ValueError("every profiled cell needs at least one timing")
    ns = np.array([n for n, _ in cells], dtype=np.float64)
    medians = np.array([float(np.median(v)) for _, v in cells])
    kept = [(n, float(m)) for (n, _), m in zip(cells, medians)]
    if len(cells) < 5 or min(len(v) for _, v in cells) < 2:
        return kept, False
    deviations = np.concatenate([np.abs(v - m) for (_, v), m in zip(cells, medians)])
    sigma = _MAD_SIGMA * float(np.median(deviations))
    if not sigma > 0:
        return kept, False
    se = _MEDIAN_SE * sigma / np.sqrt([len(v) for _, v in cells])
    fit = robust_fit(ns, medians, se)
    z2 = np.sort(((medians - fit) / se) ** 2)
    if float(z2[:-1].sum()) > chi2_quantile(len(cells) - 5) or not (fit > 0).all():
        return kept, False
    return [(n, float(s)) for (n, _), s in zip(cells, fit)], True
