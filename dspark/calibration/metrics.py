"""Calibration metrics of survival estimates: ECE, Brier, log loss, AUROC, reports and reliability diagrams.

Every metric takes 1-D predictions in [0, 1] and binary labels (tensors, numpy arrays or lists) and returns a
float (NaN when it is undefined, e.g. no rows). Reports score a survival map on recorded rounds both as the
conditional survival c_k (against conditional labels) and as the cumulative survival a_k = c_1⋯c_k (against
cumulative labels); the headline number is the cumulative ECE pooled over positions.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dspark.atomic import save_figure_atomic
from dspark.calibration.maps import SurvivalMap, fill_unavailable, json_safe
from dspark.calibration.records import RoundRecords

ArrayLike = Any  # torch.Tensor | numpy.ndarray | Sequence[float]
DEFAULT_BINS = 20
_LOG_EPS = 1e-6


def _vec(x: ArrayLike) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    return torch.as_tensor(x, dtype=torch.float64).reshape(-1)  # lists parse straight to float64


def _pair(pred: ArrayLike, label: ArrayLike) -> tuple[torch.Tensor, torch.Tensor]:
    p, y = _vec(pred), _vec(label)
    if p.shape != y.shape:
        raise ValueError(f"predictions and labels differ in length: {p.numel()} vs {y.numel()}")
    return p, y


def _bin_index(pred: torch.Tensor, bins: int) -> torch.Tensor:
    """Equal-width bin of each prediction: bin i = [i/bins, (i+1)/bins), the last bin closed at 1."""
    return (pred * bins).long().clamp_(0, bins - 1)  # truncation is floor here: negatives clamp to bin 0


def ece_batch(preds: torch.Tensor, label: torch.Tensor, bins: int = DEFAULT_BINS) -> torch.Tensor:
    """ECE of G candidate prediction vectors [G, m] against one label vector [m], as float64 [G].

    Uses Σ_bins |Σ_{i∈bin} (p_i − y_i)| / m, which equals the count-weighted mean gap per bin.
    """
    preds = preds.to(torch.float64)
    label = label.to(torch.float64)
    g, m = preds.shape
    if m == 0:
        return torch.full((g,), float("nan"), dtype=torch.float64)
    idx = _bin_index(preds, bins).add_(torch.arange(g).view(-1, 1) * bins)
    sums = torch.zeros(g * bins, dtype=torch.float64).index_add_(0, idx.reshape(-1), (preds - label).reshape(-1))
    return sums.view(g, bins).abs().sum(1) / m


def ece(pred: ArrayLike, label: ArrayLike, bins: int = DEFAULT_BINS) -> float:
    """Expected calibration error over `bins` equal-width bins on [0, 1], weighted by bin count."""
    p, y = _pair(pred, label)
    return float(ece_batch(p.view(1, -1), y, bins)[0])


def reliability_bins(pred: ArrayLike, label: ArrayLike,
                     bins: int = DEFAULT_BINS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per bin (mean prediction, mean label, count); the means are NaN in empty bins."""
    p, y = _pair(pred, label)
    idx = _bin_index(p, bins)
    count = torch.bincount(idx, minlength=bins).to(torch.float64)
    sum_p = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, p)
    sum_y = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, y)
    return sum_p / count, sum_y / count, count


def brier(pred: ArrayLike, label: ArrayLike) -> float:
    """Mean squared error of the predicted probabilities."""
    p, y = _pair(pred, label)
    return float(((p - y) ** 2).mean()) if p.numel() else math.nan


def log_loss(pred: ArrayLike, label: ArrayLike) -> float:
    """Mean binary cross-entropy in nats, predictions clamped to [1e-6, 1 − 1e-6]."""
    p, y = _pair(pred, label)
    if not p.numel():
        return math.nan
    p = p.clamp(_LOG_EPS, 1 - _LOG_EPS)
    return float(-(y * torch.log(p) + (1 - y) * torch.log1p(-p)).mean())


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks of x, tied values sharing their mean rank."""
    order = torch.argsort(x, stable=True)
    _, inverse, counts = torch.unique_consecutive(x[order], return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)
    mean_rank = ends - (counts.to(torch.float64) - 1) / 2
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks[order] = mean_rank[inverse]
    return ranks


def auroc(pred: ArrayLike, label: ArrayLike) -> float:
    """Area under the ROC curve (Mann–Whitney U, ties count ½); NaN when a class is absent."""
    p, y = _pair(pred, label)
    pos = y > 0.5
    n_pos = int(pos.sum())
    n_neg = p.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    rank_sum = float(_average_ranks(p)[pos].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def _scores(pred: torch.Tensor, label: torch.Tensor) -> dict[str, Any]:
    return {"count": int(pred.numel()), "ece": ece(pred, label), "brier": brier(pred, label),
            "auroc": auroc(pred, label), "log_loss": log_loss(pred, label)}


def _kind_scores(pred: torch.Tensor, label: torch.Tensor, valid: torch.Tensor) -> dict[str, Any]:
    per_position = [{"position": k + 1, **_scores(pred[valid[:, k], k], label[valid[:, k], k])}
                    for k in range(pred.shape[1])]
    return {"pooled": _scores(pred[valid], label[valid]), "per_position": per_position}


def _domain_names(records: RoundRecords) -> list[str]:
    names = records.domains()
    if names in ([], [""]):
        return ["all"]
    return ["all"] + [d if d else "unlabelled" for d in names if d != "all"]


def predict(records: RoundRecords, survival_map: SurvivalMap,
            workload_maps: Mapping[str, SurvivalMap] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(conditional [n, γ], cumulative [n, γ] zero past available) survival of the records, float64; rounds of a
    domain in `workload_maps` use that map, the rest `survival_map`."""
    signals = fill_unavailable(records.signals, records.available)
    with torch.no_grad():
        cond = survival_map.conditional(signals).to(torch.float64)
        for name, m in (workload_maps or {}).items():
            rows = torch.tensor([d == name for d in records.domain], dtype=torch.bool)
            if bool(rows.any()):
                cond[rows] = m.conditional(signals[rows]).to(torch.float64)
    k = torch.arange(1, records.gamma + 1).view(1, -1)
    return cond, torch.cumprod(cond, dim=1).masked_fill_(k > records.available.view(-1, 1), 0.0)


def ece_noise_floor(cond: torch.Tensor, available: torch.Tensor, rows: torch.Tensor, draws: int = 50,
                    bins: int = DEFAULT_BINS, seed: int = 0) -> float:
    """Mean pooled cumulative ECE of these predictions against labels drawn from the predictions themselves.

    For each round, acceptance is simulated position by position from its conditional survival c_k (so the
    nested labels are correlated as real ones are), up to its available drafts; the ECE of a perfectly
    calibrated predictor on a sample of this size is then pure sampling noise. A measured ECE near this floor
    cannot be told apart from perfect calibration with this many rounds.
    """
    cond = cond[rows].to(torch.float64)
    avail = available[rows]
    n, gamma = cond.shape
    if n == 0:
        return math.nan
    k = torch.arange(1, gamma + 1).view(1, -1)
    valid = k <= avail.view(-1, 1)
    pred = torch.cumprod(cond, dim=1)[valid]
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(draws):
        survived = torch.cumprod((torch.rand(n, gamma, generator=gen, dtype=torch.float64) < cond).long(), dim=1)
        total += ece(pred, survived.to(torch.float64)[valid], bins)
    return total / draws


def ece_std_error(pred: ArrayLike, label: ArrayLike, clusters: ArrayLike, draws: int = 200,
                  bins: int = DEFAULT_BINS, seed: int = 0) -> float:
    """Standard error of the ECE, by resampling whole clusters with replacement (a cluster bootstrap).

    clusters: one id per row; the rows of a cluster (every position of every round of one prompt) are drawn
    together, because they are correlated: resampling rows as if independent understates how much the ECE
    of another draw of prompts would differ. NaN for no rows.
    """
    p, y = _pair(pred, label)
    c = torch.as_tensor(clusters, dtype=torch.long).reshape(-1)
    if c.shape != p.shape:
        raise ValueError(f"clusters and predictions differ in length: {c.numel()} vs {p.numel()}")
    if not p.numel():
        return math.nan
    _, c = torch.unique(c, return_inverse=True)
    n_clusters = int(c.max()) + 1
    idx = _bin_index(p, bins)
    gap = p - y
    gen = torch.Generator().manual_seed(seed)
    values = []
    for start in range(0, draws, 25):
        g = min(25, draws - start)
        picks = torch.randint(n_clusters, (g, n_clusters), generator=gen)
        counts = torch.zeros(g, n_clusters, dtype=torch.float64).scatter_add_(
            1, picks, torch.ones(g, n_clusters, dtype=torch.float64))
        w = counts[:, c]  # [g, m] row weights
        flat = (idx.view(1, -1) + torch.arange(g).view(-1, 1) * bins).reshape(-1)
        sums = torch.zeros(g * bins, dtype=torch.float64).index_add_(0, flat, (w * gap).reshape(-1))
        values.append(sums.view(g, bins).abs().sum(1) / w.sum(1))
    return float(torch.cat(values).std())


def calibration_report(records: RoundRecords, survival_map: SurvivalMap,
                       workload_maps: Mapping[str, SurvivalMap] | None = None) -> dict[str, Any]:
    """Score a survival map on recorded rounds, per domain and over all of them ("all").

    workload_maps: maps that score the rounds of their domain instead of `survival_map` (per-workload
    calibration); every other round is scored with `survival_map`.
    Layout: {"gamma", "rounds", "headline_ece": {domain: pooled cumulative ECE}, "ece_floor": {domain: its
    `ece_noise_floor`}, "ece_se": {domain: its `ece_std_error` over prompts}, "domains": {domain: {"rounds",
    "conditional": S, "cumulative": S}}} where S is {"pooled": scores, "per_position": [{"position": k,
    **scores}, ...]} and scores are {"count", "ece", "brier", "auroc", "log_loss"}. NaN becomes None, so the
    dict is JSON-serialisable.
    """
    labels = ["unlabelled" if d == "" else d for d in records.domain]
    cond, cum = predict(records, survival_map, workload_maps)
    cond_y, cond_valid = records.conditional_labels()
    cum_y, cum_valid = records.cumulative_labels()
    report: dict[str, Any] = {"gamma": records.gamma, "rounds": len(records), "headline_ece": {},
                              "ece_floor": {}, "ece_se": {}, "domains": {}}
    clusters = records.clusters().view(-1, 1).expand(-1, records.gamma)
    for name in _domain_names(records):
        rows = torch.ones(len(records), dtype=torch.bool) if name == "all" else \
            torch.tensor([d == name for d in labels], dtype=torch.bool)
        entry = {"rounds": int(rows.sum()),
                 "conditional": _kind_scores(cond, cond_y, cond_valid & rows.view(-1, 1)),
                 "cumulative": _kind_scores(cum, cum_y, cum_valid & rows.view(-1, 1))}
        entry["cumulative"]["pooled"]["ece_floor"] = ece_noise_floor(cond, records.available, rows)
        keep = cum_valid & rows.view(-1, 1)
        entry["cumulative"]["pooled"]["ece_se"] = ece_std_error(cum[keep], cum_y[keep], clusters[keep])
        report["domains"][name] = entry
        report["headline_ece"][name] = entry["cumulative"]["pooled"]["ece"]
        report["ece_floor"][name] = entry["cumulative"]["pooled"]["ece_floor"]
        report["ece_se"][name] = entry["cumulative"]["pooled"]["ece_se"]
    return json_safe(report)


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def format_report_table(before: dict[str, Any], after: dict[str, Any],
                        per_workload: dict[str, Any] | None = None) -> str:
    """Markdown tables, one per domain, comparing `calibration_report` results: before fitting, after (the
    pooled map) and, when given, after with per-workload maps."""
    columns = [("before", before), ("after", after)]
    if per_workload is not None:
        columns.append(("after, per workload", per_workload))
    names = list(dict.fromkeys(n for _, r in columns for n in r.get("domains", {})))
    gamma = max(int(r.get("gamma") or 0) for _, r in columns)

    def get(report: dict[str, Any], domain: str, kind: str, metric: str, position: int | None = None) -> str:
        entry = report.get("domains", {}).get(domain)
        if entry is None:
            return "–"
        block = entry[kind]
        if position is None:
            return _fmt(block["pooled"].get(metric))
        rows = block["per_position"]
        return _fmt(rows[position - 1][metric]) if position <= len(rows) else "–"

    lines: list[str] = []
    for name in names:
        rounds = next(r["domains"][name]["rounds"] for _, r in columns if name in r.get("domains", {}))
        lines += [f"### {name} ({rounds} rounds)", "",
                  "| metric | " + " | ".join(c for c, _ in columns) + " |",
                  "|---|" + "---:|" * len(columns)]
        rows = [("cumulative ECE (pooled)", "cumulative", "ece", None),
                ("ECE noise floor (perfectly calibrated, same rows)", "cumulative", "ece_floor", None),
                ("ECE standard error (prompts resampled)", "cumulative", "ece_se", None),
                ("cumulative Brier (pooled)", "cumulative", "brier", None),
                ("cumulative AUROC (pooled)", "cumulative", "auroc", None),
                ("cumulative log loss (pooled)", "cumulative", "log_loss", None),
                ("conditional ECE (pooled)", "conditional", "ece", None),
                ("cumulative rows (pooled)", "cumulative", "count", None)]
        rows += [(f"cumulative ECE k={k}", "cumulative", "ece", k) for k in range(1, gamma + 1)]
        for label, kind, metric, position in rows:
            lines.append(f"| {label} | " + " | ".join(get(r, name, kind, metric, position) for _, r in columns)
                         + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def reliability_diagram(records: RoundRecords,
                        maps: Mapping[str, SurvivalMap | tuple[SurvivalMap, Mapping[str, SurvivalMap]]],
                        path: str | Path, title: str = "", bins: int = DEFAULT_BINS) -> Path:
    """Write a PNG reliability diagram of the pooled cumulative survival a_k, one curve per map.

    A value of `maps` may be (pooled map, per-workload maps), scored as in `calibration_report`.

    Top: mean predicted vs observed survival per bin (empty bins skipped) and the diagonal; bottom: rows per bin.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels, valid = records.cumulative_labels()
    y = labels[valid]
    fig = Figure(figsize=(6.0, 7.0))
    FigureCanvasAgg(fig)
    ax, ax_count = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=1, label="perfect calibration")
    width = 1.0 / bins
    centers = (torch.arange(bins, dtype=torch.float64) + 0.5) * width
    for i, (name, survival_map) in enumerate(maps.items()):
        pooled, per_workload = survival_map if isinstance(survival_map, tuple) else (survival_map, None)
        pred = predict(records, pooled, per_workload)[1][valid]
        mean_p, mean_y, count = reliability_bins(pred, y, bins)
        seen = count > 0
        ax.plot(mean_p[seen].numpy(), mean_y[seen].numpy(), marker="o", markersize=3,
                label=f"{name} (ECE {ece(pred, y, bins):.4f})")
        bar_w = width / max(len(maps), 1)
        offset = (i - (len(maps) - 1) / 2) * bar_w
        ax_count.bar((centers + offset).numpy(), count.numpy(), width=bar_w, label=name)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("observed survival")
    ax.set_title(title or "cumulative survival a_k, pooled over positions")
    ax.legend(loc="upper left", fontsize=8)
    ax_count.set_xlabel("predicted survival")
    ax_count.set_ylabel("rows per bin")
    fig.tight_layout()
    return save_figure_atomic(fig, path)
