"""Fitting survival maps on recorded rounds.

- Sequential Temperature Scaling (drafters with a confidence head): left to right, T_k minimises the ECE of the
  cumulative survival a_k = Π_{j≤k} sigmoid(logit_j / T_j) with T_1..T_{k−1} already fixed.
- Histogram binning on top of either (`fit_binned`): per position, equal-mass bins of the base map's cumulative
  survival, each bin's value the observed survival of its rows (smoothed towards the bin's mean prediction).
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


def fit_binned(records: RoundRecords, base: SurvivalMap, bins: int = 10, smoothing: float = 2.0) -> BinnedMap:
    """Histogram binning of `base`'s cumulative survival, per position on the rows that reached it.

    Position k's inner edges are the base survival's quantiles (equal-mass bins, ties merged); a bin's value is
    (Σ labels + smoothing · mean prediction) / (rows + smoothing). A position without rows copies the previous
    one (a single bin of 0.5 at k = 1).
    """
    if bins < 1 or smoothing < 0:
        raise ValueError(f"bins must be ≥ 1 and smoothing ≥ 0, got {bins} and {smoothing}")
    with torch.no_grad():
        cond = base.conditional(fill_unavailable(records.signals, records.available)).to(torch.float64)
    a = torch.cumprod(cond, dim=1)
    labels, valid = records.cumulative_labels()
    edges: list[list[float]] = []
    values: list[list[float]] = []
    for k in range(records.gamma):
        rows = valid[:, k]
        if not bool(rows.any()):
            edges.append(list(edges[-1]) if edges else [])
            values.append(list(values[-1]) if values else [0.5])
            continue
        p, y = a[rows, k], labels[rows, k].to(torch.float64)
        inner = torch.quantile(p, torch.linspace(0, 1, bins + 1, dtype=torch.float64)[1:-1]) if bins > 1 \
            else torch.zeros(0, dtype=torch.float64)
        e = sorted({float(x) for x in inner.tolist()})
        idx = torch.bucketize(p, torch.tensor(e, dtype=torch.float64), right=True)
        n = torch.bincount(idx, minlength=len(e) + 1).to(torch.float64)
        sum_y = torch.zeros(len(e) + 1, dtype=torch.float64).index_add_(0, idx, y)
        sum_p = torch.zeros(len(e) + 1, dtype=torch.float64).index_add_(0, idx, p)
        mean_p = torch.where(n > 0, sum_p / n.clamp_min(1), torch.full_like(n, float(p.mean())))
        v = ((sum_y + smoothing * mean_p) / (n + smoothing)).clamp(1e-4, 1 - 1e-4)
        edges.append(e)
        values.append(v.tolist())
    return BinnedMap(base, edges, values)


METHODS = ("binned", "sts", "joint")


def fit_map(records: RoundRecords, has_head: bool, method: str = "binned", bins: int = 10,
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
