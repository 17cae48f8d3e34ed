"""Survival maps: from a block's signals [n, γ, 3] to conditional survival c_k and cumulative survival a_k.

a_k = c_1⋯c_k estimates P(drafts 1..k all accepted), what the scheduler ranks drafts by. A map fitted on γ
positions serves any width: positions past the fitted ones reuse the last fitted position's parameters.
`Calibration` holds one map per sampling temperature for one drafter and target, optionally a map per
workload label (e.g. domain) and temperature that rows carrying that label use instead, and reads and writes
the JSON file of a fitted calibration.
"""
from __future__ import annotations

import itertools
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from dspark.atomic import read_json, write_text_atomic
from dspark.calibration.signals import CONF_LOGIT, ENTROPY, MAX_Q

FORMAT = "dspark-calibration"
VERSION = 1
_EPS = 1e-6  # conditional survival is kept in [_EPS, 1 − _EPS]
_MIN_Q = 1e-12


def json_safe(obj: Any) -> Any:
    """obj with NaN/inf floats replaced by None, tuples by lists and tensors/numpy values by Python ones."""
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes, list, tuple, Mapping)):
        obj = obj.tolist()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _per_position(params: torch.Tensor, gamma: int, like: torch.Tensor) -> torch.Tensor:
    """The first γ rows of params, the last row repeated past the fitted length, cast like `like`."""
    if gamma > params.shape[0]:
        params = torch.cat([params, params[-1:].expand(gamma - params.shape[0], *params.shape[1:])])
    return params[:gamma].to(device=like.device, dtype=like.dtype)


class _ParamCache:
    """Per-position parameters cast for a (γ, dtype, device), computed once per combination."""

    def __init__(self, params: torch.Tensor) -> None:
        self.params = params
        self._cache: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, gamma: int, like: torch.Tensor) -> torch.Tensor:
        key = (gamma, like.dtype, like.device)
        out = self._cache.get(key)
        if out is None:
            if len(self._cache) > 64:
                self._cache.clear()
            out = self._cache[key] = _per_position(self.params, gamma, like)
        return out


def _float_dtype(signals: torch.Tensor) -> torch.Tensor:
    return signals if signals.is_floating_point() else signals.float()


def _check_signals(signals: torch.Tensor) -> None:
    if signals.dim() != 3:
        raise ValueError(f"signals must be [n, γ, 3], got {list(signals.shape)}")


def _finite_list(values: Sequence[float], name: str) -> list[float]:
    out = [float(v) for v in values]
    if not out:
        raise ValueError(f"{name} must have at least one position")
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"{name} must be finite, got {out}")
    return out


def _beyond(available: torch.Tensor, gamma: int, device: torch.device) -> torch.Tensor:
    """[n, γ] bool: positions k > available[r] (1-based k)."""
    k = torch.arange(1, gamma + 1, device=device).view(1, -1)
    return k > available.to(device).view(-1, 1)


def fill_unavailable(signals: torch.Tensor, available: torch.Tensor) -> torch.Tensor:
    """signals with NaN confidence logits at positions k > available set to 0 (a copy only when needed).

    Those positions are never scored or admitted, so padding there must not make a head map refuse the block.
    """
    logit = signals[..., CONF_LOGIT]
    nan = torch.isnan(logit) & _beyond(available, signals.shape[1], signals.device)
    if not bool(nan.any()):
        return signals
    out = signals.clone()
    out[..., CONF_LOGIT] = logit.masked_fill(nan, 0.0)
    return out


class SurvivalMap(ABC):
    """Maps signals [n, γ, 3] to conditional survival c [n, γ] in (0, 1) and cumulative survival a = cumprod(c)."""

    kind: ClassVar[str]

    @abstractmethod
    def conditional(self, signals: torch.Tensor) -> torch.Tensor:
        """Conditional survival c_k = P(draft k accepted | drafts 1..k−1 accepted), [n, γ]."""

    @abstractmethod
    def params(self) -> dict[str, Any]:
        """The map's parameters as JSON-ready lists (the map's file entry without "kind")."""

    @property
    @abstractmethod
    def length(self) -> int:
        """Number of fitted positions."""

    reads_head: ClassVar[bool] = False  # whether the map reads the confidence-head logit (signal channel 0)

    @property
    def reads_q(self) -> bool:
        """Whether the map reads the drafting distribution's shape (channels 1-2: a greedy row's peak)."""
        return False

    def survival(self, signals: torch.Tensor, available: torch.Tensor) -> torch.Tensor:
        """Cumulative survival a_k = c_1⋯c_k [n, γ], zero for positions k > available[r]."""
        c = self.conditional(signals)
        return torch.cumprod(c, dim=1).masked_fill_(_beyond(available, c.shape[1], c.device), 0.0)

    def to_dict(self) -> dict[str, Any]:
        """{"kind": ..., **params}."""
        return {"kind": self.kind, **self.params()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v}' for k, v in self.params().items())})"


class _HeadMap(SurvivalMap):
    """A map reading the confidence head's logit, which must be finite wherever a draft is available."""

    reads_head = True

    def _logit(self, signals: torch.Tensor) -> torch.Tensor:
        logit = signals[..., CONF_LOGIT]
        if bool(torch.isnan(logit).any()):
            raise ValueError(f"{type(self).__name__} needs confidence-head logits (signal channel 0), got NaN: this "
                             "drafter has no confidence head; use a LogisticMap or ConstantMap")
        return logit

    def survival(self, signals: torch.Tensor, available: torch.Tensor) -> torch.Tensor:
        """As `SurvivalMap.survival`; NaN logits only past `available` (padding) are allowed."""
        _check_signals(signals)
        return super().survival(fill_unavailable(signals, available), available)


class HeadTemperatureMap(_HeadMap):
    """c_k = sigmoid(logit_k / T_k) of the confidence head (Sequential Temperature Scaling)."""

    kind = "head-temperature"

    def __init__(self, temperatures: Sequence[float]) -> None:
        temps = _finite_list(temperatures, "temperatures")
        if min(temps) <= 0:
            raise ValueError(f"temperatures must be positive, got {temps}")
        self.temperatures = temps
        self._t = _ParamCache(torch.tensor(temps, dtype=torch.float64))

    @property
    def length(self) -> int:
        return len(self.temperatures)

    def params(self) -> dict[str, Any]:
        return {"temperatures": list(self.temperatures)}

    def conditional(self, signals: torch.Tensor) -> torch.Tensor:
        _check_signals(signals)
        logit = self._logit(_float_dtype(signals))
        t = self._t.get(logit.shape[1], logit)
        return torch.sigmoid(logit / t).clamp_(_EPS, 1 - _EPS)


class LogisticMap(SurvivalMap):
    """c_k = sigmoid(w_k0 + w_k1·log max_q + w_k2·entropy) where max_q is finite, else sigmoid(prior_k).

    The map for drafters without a confidence head: sampled rows read their drafting distribution's shape,
    greedy rows and drafters without probabilities get a per-position prior.
    """

    kind = "logistic"

    def __init__(self, prior: Sequence[float], weights: Sequence[Sequence[float]]) -> None:
        prior_list = _finite_list(prior, "prior")
        rows = [_finite_list(w, f"weights[{k}]") for k, w in enumerate(weights)]
        if len(rows) != len(prior_list):
            raise ValueError(f"prior has {len(prior_list)} positions but weights has {len(rows)}")
        if any(len(w) != 3 for w in rows):
            raise ValueError(f"each weights row must be [w0, w_log_max_q, w_entropy], got {rows}")
        self.prior = prior_list
        self.weights = rows
        self._prior = _ParamCache(torch.tensor(prior_list, dtype=torch.float64))
        self._w = _ParamCache(torch.tensor(rows, dtype=torch.float64))

    @property
    def length(self) -> int:
        return len(self.prior)

    def params(self) -> dict[str, Any]:
        return {"prior": list(self.prior), "weights": [list(w) for w in self.weights]}

    @property
    def reads_q(self) -> bool:
        return any(w[1] != 0 or w[2] != 0 for w in self.weights)

    def conditional(self, signals: torch.Tensor) -> torch.Tensor:
        _check_signals(signals)
        s = _float_dtype(signals)
        max_q, entropy = s[..., MAX_Q], s[..., ENTROPY]
        gamma = s.shape[1]
        w = self._w.get(gamma, max_q)
        prior = self._prior.get(gamma, max_q)
        z = w[:, 0] + w[:, 1] * torch.log(max_q.clamp_min(_MIN_Q)) + w[:, 2] * torch.nan_to_num(entropy, nan=0.0)
        z = torch.where(torch.isfinite(max_q), z, prior)
        return torch.sigmoid(z).clamp_(_EPS, 1 - _EPS)


class HeadLogisticMap(_HeadMap):
    """c_k = sigmoid(w_k0 + w_k1·logit_k + w_k2·log max_q + w_k3·entropy) where max_q is finite, else
    sigmoid(u_k0 + u_k1·logit_k): the confidence head's logit joined with the drafting distribution's shape.

    For drafters with a confidence head. The head reads x_{k−1}, max_q and the entropy read q_k (a greedy row's
    peak), so the map stays non-anticipating; rows without a finite max_q fall back to a rescaled head.
    """

    kind = "head-logistic"

    def __init__(self, head: Sequence[Sequence[float]], weights: Sequence[Sequence[float]]) -> None:
        head_rows = [_finite_list(u, f"head[{k}]") for k, u in enumerate(head)]
        rows = [_finite_list(w, f"weights[{k}]") for k, w in enumerate(weights)]
        if not rows or len(rows) != len(head_rows):
            raise ValueError(f"head has {len(head_rows)} positions but weights has {len(rows)}")
        if any(len(u) != 2 for u in head_rows) or any(len(w) != 4 for w in rows):
            raise ValueError("each head row must be [u0, u_logit] and each weights row [w0, w_logit, "
                             f"w_log_max_q, w_entropy], got {head_rows} and {rows}")
        self.head = head_rows
        self.weights = rows
        self._u = _ParamCache(torch.tensor(head_rows, dtype=torch.float64))
        self._w = _ParamCache(torch.tensor(rows, dtype=torch.float64))

    @property
    def length(self) -> int:
        return len(self.weights)

    def params(self) -> dict[str, Any]:
        return {"head": [list(u) for u in self.head], "weights": [list(w) for w in self.weights]}

    @property
    def reads_q(self) -> bool:
        return any(w[2] != 0 or w[3] != 0 for w in self.weights)

    def conditional(self, signals: torch.Tensor) -> torch.Tensor:
        _check_signals(signals)
        s = _float_dtype(signals)
        logit, max_q, entropy = self._logit(s), s[..., MAX_Q], s[..., ENTROPY]
        gamma = s.shape[1]
        w, u = self._w.get(gamma, logit), self._u.get(gamma, logit)
        joint = w[:, 0] + w[:, 1] * logit + w[:, 2] * torch.log(max_q.clamp_min(_MIN_Q)) \
            + w[:, 3] * torch.nan_to_num(entropy, nan=0.0)
        z = torch.where(torch.isfinite(max_q), joint, u[:, 0] + u[:, 1] * logit)
        return torch.sigmoid(z).clamp_(_EPS, 1 - _EPS)


class ConstantMap(SurvivalMap):
    """A fixed conditional survival per position (the uncalibrated default of drafters without a head)."""

    kind = "constant"

    def __init__(self, values: Sequence[float]) -> None:
        vals = _finite_list(values, "values")
        if not all(0 < v < 1 for v in vals):
            raise ValueError(f"constant survival values must lie in (0, 1), got {vals}")
        self.values = vals
        self._v = _ParamCache(torch.tensor(vals, dtype=torch.float64))

    @property
    def length(self) -> int:
        return len(self.values)

    def params(self) -> dict[str, Any]:
        return {"values": list(self.values)}

    def conditional(self, signals: torch.Tensor) -> torch.Tensor:
        _check_signals(signals)
        s = _float_dtype(signals)
        v = self._v.get(s.shape[1], s)
        return v.view(1, -1).expand(s.shape[0], -1).clamp(_EPS, 1 - _EPS)


class BinnedMap(SurvivalMap):
    """Histogram binning on top of another map: a_k = min(a_{k−1}, v_k[bin_k(â_k)]) where â_k is the base map's
    cumulative survival, bin_k its bin among the fitted edges of position k, and v_k the bin's observed survival.

    Bins need not be monotone: they fix what a monotone rescaling (a temperature) cannot, e.g. a head whose
    middle range carries no information. The min keeps a_k non-increasing in k, so each row's admitted drafts
    stay a prefix. It reads only what the base map reads (non-anticipating when the base is).
    """

    kind = "binned"

    def __init__(self, base: SurvivalMap, edges: Sequence[Sequence[float]], values: Sequence[Sequence[float]]) -> None:
        if isinstance(base, BinnedMap):
            raise ValueError("the base of a binned map cannot itself be binned")
        edge_rows = [[float(e) for e in row] for row in edges]
        value_rows = [_finite_list(v, f"values[{k}]") for k, v in enumerate(values)]
        if not value_rows or len(edge_rows) != len(value_rows):
            raise ValueError(f"binned map needs one edges row per values row, got {len(edge_rows)} and "
                             f"{len(value_rows)}")
        for k, (e, v) in enumerate(zip(edge_rows, value_rows)):
            if len(e) != len(v) - 1:
                raise ValueError(f"position {k + 1}: {len(v)} bins need {len(v) - 1} inner edges, got {len(e)}")
            if any(not math.isfinite(x) for x in e) or any(b <= a for a, b in zip(e, e[1:])):
                raise ValueError(f"position {k + 1}: edges must be finite and increasing, got {e}")
            if not all(0 < x < 1 for x in v):
                raise ValueError(f"position {k + 1}: bin values must lie in (0, 1), got {v}")
        self.base = base
        self.edges = edge_rows
        self.values = value_rows
        self._table_cache: dict[tuple, tuple[torch.Tensor, ...]] = {}  # see _tables

    @property
    def reads_head(self) -> bool:  # type: ignore[override]
        return self.base.reads_head

    @property
    def reads_q(self) -> bool:
        return self.base.reads_q

    @property
    def length(self) -> int:
        return len(self.values)

    def params(self) -> dict[str, Any]:
        return {"base": self.base.to_dict(), "edges": [list(e) for e in self.edges],
                "values": [list(v) for v in self.values]}

    def _tables(self, gamma: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(edges [γ, E] padded with +inf, edge counts [γ], flat bin values with row offsets [γ]) for γ positions
        (positions past the fitted ones use the last), cached per γ, dtype and device: built once, not per step."""
        key = (gamma, like.dtype, like.device)
        cache = self._table_cache
        hit = cache.get(key)
        if hit is None:
            rows = [min(k, len(self.values) - 1) for k in range(gamma)]
            width = max(1, max(len(self.edges[j]) for j in rows))
            edges = torch.full((gamma, width), math.inf, dtype=like.dtype)
            for k, j in enumerate(rows):
                edges[k, : len(self.edges[j])] = torch.tensor(self.edges[j], dtype=like.dtype)
            counts = torch.tensor([len(self.edges[j]) for j in rows])
            flat = torch.tensor([v for j in rows for v in self.values[j]], dtype=like.dtype)
            offsets = torch.tensor([0, *itertools.accumulate(len(self.values[j]) for j in rows[:-1])])
            hit = cache[key] = (edges.to(like.device), counts.to(like.device), flat.to(like.device),
                                offsets.to(like.device))
        return hit

    def cumulative(self, signals: torch.Tensor) -> torch.Tensor:
        """a_k [n, γ] before masking by the available drafts."""
        base = torch.cumprod(self.base.conditional(signals), dim=1)
        if base.shape[1] == 0:
            return base
        edges, counts, flat, offsets = self._tables(base.shape[1], base)
        # the bin of x among increasing edges (right-closed, as bucketize(right=True)); NaN in the top bin
        bins = (base.unsqueeze(-1) >= edges).sum(-1)
        bins = torch.where(torch.isnan(base), counts, bins)
        return torch.cummin(flat[offsets + bins], dim=1).values.clamp_(max=1.0)

    def conditional(self, signals: torch.Tensor) -> torch.Tensor:
        _check_signals(signals)
        a = self.cumulative(_float_dtype(signals)).clamp(_EPS, 1 - _EPS)
        prev = torch.cat([torch.ones_like(a[:, :1]), a[:, :-1]], dim=1)
        return (a / prev).clamp_(_EPS, 1 - _EPS)

    def survival(self, signals: torch.Tensor, available: torch.Tensor) -> torch.Tensor:
        """As `SurvivalMap.survival`; NaN head logits only past `available` (padding) are allowed."""
        _check_signals(signals)
        return super().survival(fill_unavailable(signals, available), available)


MAP_KINDS: dict[str, type[SurvivalMap]] = {m.kind: m for m in (HeadTemperatureMap, HeadLogisticMap, LogisticMap,
                                                                ConstantMap, BinnedMap)}


def default_map(has_head: bool, gamma: int) -> SurvivalMap:
    """The uncalibrated map: the raw confidence head (T = 1) if there is one, else c_k = 0.7."""
    return HeadTemperatureMap([1.0] * gamma) if has_head else ConstantMap([0.7] * gamma)


def _number_list(value: Any, where: str, length: int | None = None) -> list[float]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"field '{where}' must be a non-empty list of numbers, got {value!r:.80}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        raise ValueError(f"field '{where}' must hold finite numbers, got {value!r:.80}")
    if length is not None and len(value) != length:
        raise ValueError(f"field '{where}' must have {length} entries, got {len(value)}")
    return [float(v) for v in value]


def map_from_dict(data: Any, where: str = "map") -> SurvivalMap:
    """Rebuild a map from its `to_dict()`; ValueError names the offending field (prefixed by `where`)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"field '{where}' must be an object, got {type(data).__name__}")  # noqa: TRY004
    kind = data.get("kind")
    if kind not in MAP_KINDS:
        raise ValueError(f"field '{where}.kind' must be one of {sorted(MAP_KINDS)}, got {kind!r}")
    for name in {"head-temperature": ["temperatures"], "head-logistic": ["head", "weights"],
                 "logistic": ["prior", "weights"], "constant": ["values"], "binned": ["base", "edges", "values"]}[kind]:
        if name not in data:
            raise ValueError(f"field '{where}.{name}' is missing (kind {kind!r})")
    try:
        if kind == "binned":
            base = map_from_dict(data["base"], f"{where}.base")
            rows = data["values"]
            if not isinstance(rows, list) or not rows or not isinstance(data["edges"], list) \
                    or len(data["edges"]) != len(rows):
                raise ValueError(f"field '{where}.edges' must be a list of rows, one per row of '{where}.values'")
            values = [_number_list(v, f"{where}.values[{k}]") for k, v in enumerate(rows)]
            edges = [[] if e == [] else _number_list(e, f"{where}.edges[{k}]") for k, e in enumerate(data["edges"])]
            return BinnedMap(base, edges, values)
        if kind == "head-temperature":
            return HeadTemperatureMap(_number_list(data["temperatures"], f"{where}.temperatures"))
        if kind == "constant":
            return ConstantMap(_number_list(data["values"], f"{where}.values"))
        if kind == "head-logistic":
            head, weights = data["head"], data["weights"]
            if not isinstance(head, list) or not head or not isinstance(weights, list) or len(weights) != len(head):
                raise ValueError(f"field '{where}.weights' must be a list of rows, one per row of '{where}.head'")
            return HeadLogisticMap([_number_list(u, f"{where}.head[{k}]", 2) for k, u in enumerate(head)],
                                   [_number_list(w, f"{where}.weights[{k}]", 4) for k, w in enumerate(weights)])
        prior = _number_list(data["prior"], f"{where}.prior")
        weights = data["weights"]
        if not isinstance(weights, list) or len(weights) != len(prior):
            raise ValueError(f"field '{where}.weights' must be a list of {len(prior)} rows (one per prior entry)")
        return LogisticMap(prior, [_number_list(w, f"{where}.weights[{k}]", 3) for k, w in enumerate(weights)])
    except ValueError as err:
        if str(err).startswith("field "):
            raise
        raise ValueError(f"field '{where}': {err}") from None


def _temperature_key(t: float) -> str:
    return repr(float(t))


@dataclass
class Calibration:
    """Survival maps per sampling temperature (0.0 = greedy) of one drafter on one target.

    metrics: per temperature, what the fit scored (e.g. `calibration_report` before/after), stored alongside.
    workload_maps: per workload label, maps per temperature fitted on that workload's rounds only; a row
    whose request carries the label uses them (temperature chosen as in `map_for`), every other row the
    pooled `maps`.
    """

    maps: dict[float, SurvivalMap]
    drafter: str = ""
    target: str = ""
    metrics: dict[float, dict[str, Any]] = field(default_factory=dict)
    workload_maps: dict[str, dict[float, SurvivalMap]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.maps:
            raise ValueError("a calibration needs at least one map")
        maps = {float(t): m for t, m in self.maps.items()}
        bad = [t for t in maps if not (math.isfinite(t) and t >= 0)]
        if bad:
            raise ValueError(f"map temperatures must be finite and ≥ 0, got {bad}")
        self.maps = dict(sorted(maps.items()))
        self.metrics = {float(t): m for t, m in self.metrics.items()}
        workload_maps: dict[str, dict[float, SurvivalMap]] = {}
        for name, per_t in self.workload_maps.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"workload labels must be non-empty strings, got {name!r}")
            if not per_t:
                raise ValueError(f"workload {name!r} has no maps")
            wm = {float(t): m for t, m in per_t.items()}
            bad = [t for t in wm if not (math.isfinite(t) and t >= 0)]
            if bad:
                raise ValueError(f"map temperatures of workload {name!r} must be finite and ≥ 0, got {bad}")
            workload_maps[name] = dict(sorted(wm.items()))
        self.workload_maps = workload_maps

    @property
    def workloads(self) -> list[str]:
        """Workload labels with maps of their own."""
        return list(self.workload_maps)

    @property
    def reads_q(self) -> bool:
        """Whether any map (any temperature, pooled or a workload's) reads the drafting distribution's shape."""
        return any(m.reads_q for m in [*self.maps.values(), *(m for w in self.workload_maps.values()
                                                                 for m in w.values())])

    @property
    def greedy_reads_q(self) -> bool:
        """Whether a greedy row's map (pooled or a workload's) reads its peak, so drafters must report it."""
        return any(self.map_for(0.0, w).reads_q for w in [None, *self.workloads])

    def map_for(self, temperature: float, workload: str | None = None) -> SurvivalMap:
        """The map of a row: greedy (T ≤ 0) → the 0.0 map, T > 0 → the nearest positive temperature's map,
        else the nearest map; from the row's workload maps when it has one of that regime (greedy 0.0 or any
        positive temperature), else from the pooled maps."""
        t = float(temperature)
        maps = self.maps
        own = self.workload_maps.get(workload) if workload is not None else None
        if own is not None and (0.0 in own if t <= 0 else any(k > 0 for k in own)):
            maps = own
        keys = list(maps)
        if t <= 0:
            return maps[0.0] if 0.0 in maps else maps[keys[0]]
        positive = [k for k in keys if k > 0] or keys
        return maps[min(positive, key=lambda k: (abs(k - t), k))]

    def survival(self, signals: torch.Tensor, available: torch.Tensor,
                 temperatures: Sequence[float] | torch.Tensor,
                 workloads: Sequence[str | None] | None = None) -> torch.Tensor:
        """Cumulative survival [R, γ] with each row's map chosen by its sampling temperature and workload."""
        temps = temperatures.tolist() if isinstance(temperatures, torch.Tensor) else list(temperatures)
        if len(temps) != signals.shape[0]:
            raise ValueError(f"{len(temps)} temperatures for {signals.shape[0]} rows")
        names = [None] * len(temps) if workloads is None else list(workloads)
        if len(names) != len(temps):
            raise ValueError(f"{len(names)} workloads for {signals.shape[0]} rows")
        chosen: dict[tuple[float, str | None], SurvivalMap] = {}
        groups: dict[int, tuple[SurvivalMap, list[int]]] = {}
        for r, (t, w) in enumerate(zip(temps, names)):
            w = w if w in self.workload_maps else None
            m = chosen.get((t, w))
            if m is None:
                m = chosen[(t, w)] = self.map_for(t, w)
            groups.setdefault(id(m), (m, []))[1].append(r)
        if len(groups) <= 1:
            m = next(iter(groups.values()))[0] if groups else self.map_for(0.0)
            return m.survival(signals, available)
        out = torch.empty(signals.shape[:2], dtype=_float_dtype(signals).dtype, device=signals.device)
        for m, rows in groups.values():
            idx = torch.tensor(rows, dtype=torch.long, device=signals.device)
            out[idx] = m.survival(signals[idx], available[idx.to(available.device)]).to(out.dtype)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON layout of a calibration file."""
        maps = {_temperature_key(t): {**m.to_dict(), "metrics": json_safe(self.metrics.get(t, {}))}
                for t, m in self.maps.items()}
        out = {"format": FORMAT, "version": VERSION, "drafter": self.drafter, "target": self.target, "maps": maps}
        if self.workload_maps:
            out["workloads"] = {name: {_temperature_key(t): m.to_dict() for t, m in per_t.items()}
                                for name, per_t in self.workload_maps.items()}
        return out

    def to_json(self, path: str | Path) -> Path:
        """Write the calibration atomically (temporary file in the same folder, then os.replace)."""
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> Calibration:
        """Validate and rebuild a calibration; ValueError names `source` and the offending field."""
        def fail(msg: str) -> ValueError:
            return ValueError(f"calibration file {source}: {msg}")

        if not isinstance(data, Mapping):
            raise fail(f"top level must be a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise fail(f"field 'format' must be {FORMAT!r}, got {data.get('format')!r}")
        if data.get("version") != VERSION:
            raise fail(f"field 'version' must be {VERSION}, got {data.get('version')!r}")
        for name in ("drafter", "target"):
            if not isinstance(data.get(name), str):
                raise fail(f"field '{name}' must be a string, got {data.get(name)!r}")
        metrics: dict[float, dict[str, Any]] = {}

        def read_maps(raw_maps: Any, where: str, keep_metrics: bool) -> dict[float, SurvivalMap]:
            if not isinstance(raw_maps, Mapping) or not raw_maps:
                raise fail(f"field '{where}' must be a non-empty object keyed by temperature, got {raw_maps!r:.80}")
            maps: dict[float, SurvivalMap] = {}
            for key, entry in raw_maps.items():
                try:
                    t = float(key)
                except ValueError:
                    raise fail(f"field '{where}' has key {key!r}, which is not a temperature") from None
                if not (math.isfinite(t) and t >= 0):
                    raise fail(f"field '{where}' has key {key!r}; temperatures must be finite and ≥ 0")
                if t in maps:
                    raise fail(f"field '{where}' has temperature {t} twice")
                try:
                    maps[t] = map_from_dict(entry, f"{where}.{key}")
                except ValueError as err:
                    raise fail(str(err)) from None
                if keep_metrics:
                    entry_metrics = entry.get("metrics", {})
                    if not isinstance(entry_metrics, Mapping):
                        raise fail(f"field '{where}.{key}.metrics' must be an object, "
                                   f"got {type(entry_metrics).__name__}")
                    metrics[t] = dict(entry_metrics)
            return maps

        maps = read_maps(data.get("maps"), "maps", True)
        raw_workloads = data.get("workloads", {})
        if not isinstance(raw_workloads, Mapping):
            raise fail(f"field 'workloads' must be an object keyed by workload label, "
                       f"got {type(raw_workloads).__name__}")
        workload_maps = {}
        for name, raw in raw_workloads.items():
            if not name:
                raise fail("field 'workloads' has an empty workload label")
            workload_maps[name] = read_maps(raw, f"workloads.{name}", False)
        return cls(maps=maps, drafter=data["drafter"], target=data["target"], metrics=metrics,
                   workload_maps=workload_maps)

    @classmethod
    def load(cls, path: str | Path, expect_drafter: str | None = None,
             expect_target: str | None = None) -> Calibration:
        """Read a calibration file, checking that it belongs to the given drafter and target (when given).

        A missing, unreadable, truncated or malformed file, or one for another drafter or target, raises
        ValueError naming the file and the field (and both values on a mismatch).
        """
        p = Path(path)
        data = read_json(p, "calibration file")
        cal = cls.from_dict(data, source=str(p))
        for name, expected in (("drafter", expect_drafter), ("target", expect_target)):
            found = getattr(cal, name)
            if expected is not None and found != expected:
                raise ValueError(f"calibration file {p} is for {name} {found!r}, but the {name} in use is "
                                 f"{expected!r} (field '{name}')")
        return cal
