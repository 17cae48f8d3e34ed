"""Fitting survival maps on recorded rounds.

- Sequential Temperature Scaling (drafters with a confidence head): left to right, T_k minimises the ECE of the
  cumulative survival a_k = Π_{j≤k} sigmoid(logit_j / T_j) with T_1..T_{k−1} already fixed.
- Monotone histogram binning on top of either (`fit_binned`): equal-mass bins of the base map's cumulative
  survival shared by all positions, each cell (position, bin) its rows' observed survival (smoothed towards
  their mean prediction), fitted to rise with the bin and fall with the position so a_k never rises along a block.
- Logistic maps (drafters without a head): per position, a logistic regression of the conditional label on
  log max_q and the entropy of the drafting distribution (a greedy row's peak), a smoothed prior for the rest.
- Head-logistic maps (method "joint"): the same regression with the head logit as a third input.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dspark.calibration.maps import (BinnedMap, HeadLogisticMap, HeadTemperatureMap, LogisticMap, SurvivalMap,
                                    fill_unavailable)
from dspark.calibration.metrics import DEFAULT_BINS, ece_batch
from dspark.calibration.records import RoundRecords
from dspark.calibration.signals import CONF_LOGIT, ENTROPY, MAX_Q

_CHUNK_ELEMENTS = 1 << 22  # candidate temperatures × rows scored at once
_TIE_TOL = 1e-12


def default_temperature_grid() -> torch.Tensor:
    """241 temperatures, geometric from 0.05 to 20, with 1.0 exactly among them."""
    grid = torch.logspace(math.log10(0.05), math.log10(20.0), 241, dtype=torch.float64)
    grid[torch.argmin((grid - 1.0).abs())] = 1.0
    return grid


def _grid(grid: Sequence[float] | torch.Tensor | None) -> torch.Tensor:
    if grid is None:
        return default_temperature_grid()
    g = torch.as_tensor(grid, dtype=torch.float64).reshape(-1)
    if g.numel() == 0 or not bool(torch.isfinite(g).all()) or bool((g <= 0).any()):
        raise ValueError("the temperature grid must be a non-empty list of positive finite numbers")
    return g


def fit_sequential_temperature(records: RoundRecords, grid: Sequence[float] | torch.Tensor | None = None,
                               bins: int = DEFAULT_BINS) -> HeadTemperatureMap:
    """Sequential Temperature Scaling of the confidence head on the cumulative labels (ties → T closest to 1).

    Position k is scored on rounds with available ≥ k; a position without such rounds keeps T = 1.
    """
    g = _grid(grid)
    preference = torch.argsort(g.log().abs(), stable=True)  # candidates ordered by closeness to 1
    logits = records.signals[..., CONF_LOGIT].to(torch.float64)
    labels, valid = records.cumulative_labels()
    if bool(torch.isnan(logits[valid]).any()):
        raise ValueError("Sequential Temperature Scaling needs confidence-head logits (signal channel 0), got "
                         "NaN: this drafter has no confidence head; fit a logistic map instead")
    prefix = torch.ones(len(records), dtype=torch.float64)
    temps: list[float] = []
    for k in range(records.gamma):
        rows = valid[:, k]
        if not bool(rows.any()):
            temps.append(1.0)
            continue
        z, pre, y = logits[rows, k], prefix[rows], labels[rows, k].to(torch.float64)
        chunk = max(1, _CHUNK_ELEMENTS // z.numel())
        errs = torch.cat([ece_batch(torch.sigmoid_(z / part.view(-1, 1)).mul_(pre), y, bins)
                          for part in g.split(chunk)])
        ties = errs[preference] <= errs.min() + _TIE_TOL
        t = float(g[preference[int(torch.nonzero(ties)[0])]])
        temps.append(t)
        prefix = prefix * torch.sigmoid(torch.nan_to_num(logits[:, k], nan=0.0) / t)
    return HeadTemperatureMap(temps)


def _smoothed_logit(y: torch.Tensor) -> float:
    """Log-odds of the Laplace-smoothed mean (Σy + 1) / (n + 2)."""
    p = (float(y.sum()) + 1.0) / (y.numel() + 2.0)
    return math.log(p) - math.log1p(-p)


def _fit_logistic_regression(x: torch.Tensor, y: torch.Tensor, l2: float, max_iter: int = 200) -> list[float]:
    """[w0, w1, …] minimising mean log loss of sigmoid(w0 + x·w) + l2‖w‖² (on standardised features x [n, d]).

    The intercept gets l2·1e-3, which only keeps a position whose labels are all equal finite.
    """
    mean = x.mean(0)
    std = x.std(0, unbiased=False)
    std = torch.where(std > 1e-8, std, torch.ones_like(std))
    xs = (x - mean) / std
    theta = torch.zeros(1 + x.shape[1], dtype=torch.float64)
    theta[0] = _smoothed_logit(y)
    theta.requires_grad_(True)
    opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=max_iter, tolerance_grad=1e-10, tolerance_change=1e-14,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        z = theta[0] + xs @ theta[1:]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z, y)
        loss = loss + l2 * (theta[1:] ** 2).sum() + l2 * 1e-3 * theta[0] ** 2
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    b, v = theta.detach()[0], theta.detach()[1:]
    slopes = v / std
    return [float(b - (slopes * mean).sum()), *(float(w) for w in slopes)]


def fit_logistic(records: RoundRecords, l2: float = 1e-3) -> LogisticMap:
    """Per-position logistic map on the conditional labels.

    Rows with a finite max_q (sampled rows with a drafting distribution) fit (w0, w1, w2) on log max_q and the
    entropy with LBFGS in float64; the prior is the smoothed log-odds of the other rows (of all the position's
    rows if every row is sampled). A position with only prior rows gives sampled rows the prior too; a position
    with no rows copies the previous one (prior 0 and zero weights at k = 1).
    """
    labels, valid = records.conditional_labels()
    max_q = records.signals[..., MAX_Q].to(torch.float64)
    entropy = torch.nan_to_num(records.signals[..., ENTROPY].to(torch.float64), nan=0.0)
    priors: list[float] = []
    weights: list[list[float]] = []
    for k in range(records.gamma):
        rows = valid[:, k]
        if not bool(rows.any()):
            priors.append(priors[-1] if priors else 0.0)
            weights.append(list(weights[-1]) if weights else [0.0, 0.0, 0.0])
            continue
        sampled = rows & torch.isfinite(max_q[:, k])
        unsampled = rows & ~torch.isfinite(max_q[:, k])
        y = labels[:, k].to(torch.float64)
        prior = _smoothed_logit(y[unsampled] if bool(unsampled.any()) else y[rows])
        if bool(sampled.any()):
            x = torch.stack([torch.log(max_q[sampled, k].clamp_min(1e-12)), entropy[sampled, k]], dim=1)
            w = _fit_logistic_regression(x, y[sampled], l2)
        else:
            w = [prior, 0.0, 0.0]
        priors.append(prior)
        weights.append(w)
    return LogisticMap(priors, weights)


def fit_head_logistic(records: RoundRecords, l2: float = 1e-3) -> HeadLogisticMap:
    """Per-position logistic map of the conditional labels on the head logit joined with log max_q and the
    entropy (rows with a finite max_q: sampled rows and greedy rows' peaks), with a head-only fallback fitted
    on every row of the position. A position with no rows copies the previous one (the raw head at k = 1)."""
    labels, valid = records.conditional_labels()
    logit = records.signals[..., CONF_LOGIT].to(torch.float64)
    if bool(torch.isnan(logit[valid]).any()):
        raise ValueError("a head-logistic map needs confidence-head logits (signal channel 0), got NaN: this "
                         "drafter has no confidence head; fit a logistic map instead")
    max_q = records.signals[..., MAX_Q].to(torch.float64)
    entropy = torch.nan_to_num(records.signals[..., ENTROPY].to(torch.float64), nan=0.0)
    head: list[list[float]] = []
    weights: list[list[float]] = []
    for k in range(records.gamma):
        rows = valid[:, k]
        if not bool(rows.any()):
            head.append(list(head[-1]) if head else [0.0, 1.0])
            weights.append(list(weights[-1]) if weights else [0.0, 1.0, 0.0, 0.0])
            continue
        y = labels[:, k].to(torch.float64)
        head.append(_fit_logistic_regression(logit[rows, k].unsqueeze(1), y[rows], l2))
        joint = rows & torch.isfinite(max_q[:, k])
        if bool(joint.any()):
            x = torch.stack([logit[joint, k], torch.log(max_q[joint, k].clamp_min(1e-12)), entropy[joint, k]], 1)
            weights.append(_fit_logistic_regression(x, y[joint], l2))
        else:
            weights.append([*head[-1], 0.0, 0.0])
    return HeadLogisticMap(head, weights)


def _isotonic_1d(y: list[float], w: list[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit of y (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [value, weight, count]
    for yi, wi in zip(y, w):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks[-1]
            total = w1 + w2
            blocks[-1] = [(v1 * w1 + v2 * w2) / total if total > 0 else (v1 + v2) / 2, total, c1 + c2]
    return [v for v, _, c in blocks for _ in range(c)]


def monotone_cells(y: torch.Tensor, w: torch.Tensor, iters: int = 2000, tol: float = 1e-9) -> torch.Tensor:
    """The weighted least-squares fit of y [K, B] that is non-decreasing along B (a position's bins) and
    non-increasing along K (positions): Dykstra's alternating projections onto the two orders, each a pool
    adjacent violators pass per row / column, then a cumulative max along B and min along K that makes the
    result feasible exactly (a change of the order of `tol`)."""
    y, w = y.to(torch.float64), w.to(torch.float64)
    x, p, q = y.clone(), torch.zeros_like(y), torch.zeros_like(y)
    wl = w.tolist()
    wt = w.T.tolist()
    for _ in range(iters):
        z = (x + p).tolist()
        a = torch.tensor([_isotonic_1d(row, wr) for row, wr in zip(z, wl)], dtype=torch.float64)
        p = x + p - a
        z2 = (a + q).T.tolist()  # columns, reversed so that "non-increasing in k" is a non-decreasing fit
        b = torch.tensor([_isotonic_1d(col[::-1], wc[::-1])[::-1] for col, wc in zip(z2, wt)], dtype=torch.float64).T
        q = a + q - b
        done = float((a - b).abs().max()) < tol and float((b - x).abs().max()) < tol
        x = b.contiguous()
        if done:
            break
    return torch.cummin(torch.cummax(x, dim=1).values, dim=0).values


def fit_binned(records: RoundRecords, base: SurvivalMap, bins: int = 20, smoothing: float = 2.0) -> BinnedMap:
    """Monotone histogram binning of `base`'s cumulative survival â_k.

    The bins are shared by every position: equal-mass quantiles of â over all (round, position) pairs that
    reached the position (ties merged). A cell (position k, bin b) starts at its rows' observed survival,
    smoothed towards their mean prediction, (Σ labels + smoothing · mean â) / (rows + smoothing) (an empty
    cell: the bin's midpoint, weight `smoothing`). The cells are then fitted, weighted by rows + smoothing,
    to be non-decreasing in b and non-increasing in k (`monotone_cells`). Since â_k ≤ â_{k−1} puts draft k
    in a bin no higher than draft k−1's, every row's survival then falls along its block by construction:
    `BinnedMap`'s cap a_k = min(a_{k−1}, ·) changes nothing, so it no longer pulls fitted values below the
    observed survival (what per-position bins under the cap did; docs/scheduling.md).
    """
    if bins < 1 or smoothing < 0:
        raise ValueError(f"bins must be ≥ 1 and smoothing ≥ 0, got {bins} and {smoothing}")
    with torch.no_grad():
        cond = base.conditional(fill_unavailable(records.signals, records.available)).to(torch.float64)
    a = torch.cumprod(cond, dim=1)
    labels, valid = records.cumulative_labels()
    gamma = records.gamma
    reached = a[valid]
    if reached.numel() and bins > 1:
        inner = torch.quantile(reached, torch.linspace(0, 1, bins + 1, dtype=torch.float64)[1:-1])
        edges = sorted({float(x) for x in inner.tolist()} - {0.0, 1.0})
    else:
        edges = []
    e = torch.tensor(edges, dtype=torch.float64)
    width = len(edges) + 1
    bounds = torch.cat([torch.zeros(1, dtype=torch.float64), e, torch.ones(1, dtype=torch.float64)])
    midpoint = (bounds[:-1] + bounds[1:]) / 2
    y = torch.empty(gamma, width, dtype=torch.float64)
    w = torch.empty(gamma, width, dtype=torch.float64)
    for k in range(gamma):
        rows = valid[:, k]
        p, lab = a[rows, k], labels[rows, k].to(torch.float64)
        idx = torch.bucketize(p, e, right=True)
        n = torch.bincount(idx, minlength=width).to(torch.float64)
        sum_y = torch.zeros(width, dtype=torch.float64).index_add_(0, idx, lab)
        sum_p = torch.zeros(width, dtype=torch.float64).index_add_(0, idx, p)
        mean_p = torch.where(n > 0, sum_p / n.clamp_min(1), midpoint)
        denom = n + smoothing
        y[k] = torch.where(denom > 0, (sum_y + smoothing * mean_p) / denom.clamp_min(1e-12), mean_p)
        w[k] = denom.clamp_min(1e-9)
    values = monotone_cells(y, w).clamp(1e-4, 1 - 1e-4)
    return BinnedMap(base, [list(edges)] * gamma, values.tolist())


METHODS = ("binned", "sts", "joint")


def fit_map(records: RoundRecords, has_head: bool, method: str = "binned", bins: int = 20,
            smoothing: float = 2.0) -> SurvivalMap:
    """The base map, then histogram binning on top of it (`fit_binned`'s bins and smoothing) unless method is
    "sts". Base: for a drafter with a confidence head, Sequential Temperature Scaling ("binned", "sts") or the
    head joined with the drafting distribution's shape ("joint", `fit_head_logistic`); without a head, the
    logistic map of that shape whatever the method."""
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}: choose one of {', '.join(METHODS)}")
    if not has_head:
        base: SurvivalMap = fit_logistic(records)
    else:
        base = fit_head_logistic(records) if method == "joint" else fit_sequential_temperature(records)
    return base if method == "sts" else fit_binned(records, base, bins, smoothing)
