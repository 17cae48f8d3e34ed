"""Online calibration: keep a survival map true while serving, from the outcomes of verified rounds.

The offline calibration (a `Calibration` or one `SurvivalMap`) is the prior. Per (workload, regime) with regime
greedy | sampled, and per position k, an affine correction of the prior's conditional logit

    c'_k = sigmoid(α_k · logit(c_k) + β_k),   starting at α = 1, β = 0 (the prior itself),

is refitted every `refit_every` observed rounds of that workload and regime (through the engine's per-step
`observe_step`, at most once every `refit_steps` steps) on a forgetting window of its
conditional labels (draft k reached: accepted ≥ k − 1 and available ≥ k) by damped Newton steps on the
weighted log loss plus a ridge pulling towards (1, 0) and (``position_ridge``) towards the correction shared
by all positions. Serving reads only signals (non-anticipating) and has `Calibration.survival`'s contract, so
an `OnlineCalibrator` can stand where a drafter's `Calibration` does.

Guards, since the state is fed by user traffic:
- malformed rounds (wrong shape, NaN/inf where the prior reads, negative counts, accepted > available) are
  rejected and counted, never stored;
- outcomes of requests whose target sampling the drafter does not see (``pooled=False``: logit bias,
  penalties, allowed tokens, grammar) are counted and ignored;
- one request's weight in a window is capped at ``max_request_share`` of the effective window size
  (``request_cap``); with request_cap < min_rounds (defaults: 20 < 50) one request alone never makes a
  workload's fit served. The cap bounds weight, not leverage: rejections placed on confident rows move a
  logistic fit more than their share (benchmarks/results/online_calibration);
- each refit moves every parameter by at most ``max_step`` (and α, β stay in fixed bounds);
- labelled workloads are kept apart: a label's rounds only fit that label's correction. Unlabelled rounds
  (and labels beyond ``max_workloads`` or outside a declared ``workloads`` list) are pooled into the
  "default" workload; a workload with fewer than ``min_rounds`` effective rounds is served the default
  workload's correction, or the prior when the default has too few as well. A workload with offline maps of
  its own (`Calibration.workload_maps`) has those as its prior, and is served them until its own fit is.
"""
from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dspark.calibration.maps import (
    Calibration,
    SurvivalMap,
    fill_unavailable,
    json_safe,
)
from dspark.calibration.metrics import DEFAULT_BINS
from dspark.calibration.records import RoundRecords
from dspark.calibration.signals import CONF_LOGIT, NUM_SIGNALS

DEFAULT = "default"
REGIMES = ("greedy", "sampled")
_EPS = 1e-6
_ALPHA_BOUNDS = (0.05, 20.0)
_BETA_BOUNDS = (-10.0, 10.0)
_MIN_WEIGHT = 1e-2  # with decay and no window, rounds older than this weight leave the buffer (1% of the weight)
_MAX_LABEL = 256  # longest workload label accepted
_FULL_STEP = 0.5  # a Newton step moving no logit by more than this is taken without a line search


def _logit(c: torch.Tensor) -> torch.Tensor:
    c = c.to(torch.float64).clamp(_EPS, 1 - _EPS)
    return torch.log(c) - torch.log1p(-c)


def _extend(params: torch.Tensor, gamma: int) -> torch.Tensor:
    """The first γ entries of per-position params [..., n], the last one repeated past n."""
    n = params.shape[-1]
    if gamma > n:
        params = torch.cat([params, params[..., -1:].expand(*params.shape[:-1], gamma - n)], dim=-1)
    return params[..., :gamma]


def weighted_ece(pred: torch.Tensor, label: torch.Tensor, weight: torch.Tensor, bins: int = DEFAULT_BINS) -> float:
    """ECE over `bins` equal-width bins with row weights: Σ_bins |Σ w (p − y)| / Σ w (NaN without weight)."""
    p, y, w = (t.reshape(-1).to(torch.float64) for t in (pred, label, weight))
    total = float(w.sum())
    if total <= 0:
        return math.nan
    idx = (p * bins).long().clamp_(0, bins - 1)
    sums = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, w * (p - y))
    return float(sums.abs().sum() / total)


@dataclass
class _Stream:
    """The window and correction of one (workload, regime): a ring buffer of rounds and the fitted α, β.

    Rounds are stored as given (signals, counts, the temperature choosing the prior map); the prior's
    conditional logits of new rounds are computed in one batch when the window is next read.
    """

    gamma: int
    capacity: int
    workload: str = DEFAULT                    # the workload whose prior maps the rounds' logits come from
    signals: np.ndarray = field(init=False)    # [C, γ, 3] float32
    z: np.ndarray = field(init=False)          # [C, γ] float64 prior conditional logits (0 past available)
    available: np.ndarray = field(init=False)  # [C] int64 (0 marks a round dropped when its logits were computed)
    accepted: np.ndarray = field(init=False)   # [C] int64
    time: np.ndarray = field(init=False)       # [C] int64 stream-local index of the round
    request: np.ndarray = field(init=False)    # [C] int64 request id (negative ids: anonymous rounds)
    temperature: np.ndarray = field(init=False)  # [C] float64
    alpha: torch.Tensor = field(init=False)    # [γ] float64
    beta: torch.Tensor = field(init=False)     # [γ] float64
    rounds: int = 0
    pending: int = 0                           # newest rounds whose prior logits are not computed yet
    since_refit: int = 0
    refits: int = 0
    refit_step: int = -(1 << 62)               # the calibrator's `observe_step` count at the last refit
    effective_rounds: float = 0.0              # Σ capped window weights at the last refit
    trusted: bool = False                      # effective_rounds ≥ min_rounds at the last refit
    last_change: float = 0.0                   # max |Δparam| of the last refit
    optimum: tuple[torch.Tensor, ...] | None = None  # the last refit's unbounded fits (shared α, β; α, β):
    #                                                  where the next refit's Newton steps start

    def __post_init__(self) -> None:
        c, g = self.capacity, self.gamma
        self.signals = np.zeros((c, g, NUM_SIGNALS), dtype=np.float32)
        self.z = np.zeros((c, g), dtype=np.float64)
        self.available = np.zeros(c, dtype=np.int64)
        self.accepted = np.zeros(c, dtype=np.int64)
        self.time = np.zeros(c, dtype=np.int64)
        self.request = np.zeros(c, dtype=np.int64)
        self.temperature = np.zeros(c, dtype=np.float64)
        self.alpha = torch.ones(g, dtype=torch.float64)
        self.beta = torch.zeros(g, dtype=torch.float64)

    def insert(self, signals: np.ndarray, available: int, accepted: int, request: int, temperature: float) -> None:
        slot = self.rounds % self.capacity
        self.signals[slot] = signals
        self.available[slot] = available
        self.accepted[slot] = accepted
        self.time[slot] = self.rounds
        self.request[slot] = request
        self.temperature[slot] = temperature
        self.rounds += 1
        self.pending = min(self.pending + 1, self.capacity)
        self.since_refit += 1

    def filled(self) -> int:
        return min(self.rounds, self.capacity)

    def pending_slots(self) -> np.ndarray:
        return (self.rounds - self.pending + np.arange(self.pending)) % self.capacity


class OnlineCalibrator:
    """Per-workload online correction of an offline survival calibration (see the module docstring).

    prior: the offline `Calibration`, or one `SurvivalMap` used at every temperature.
    gamma: positions with their own correction (later positions reuse the last one).
    decay: weight factor per observed round of a workload and regime (exponential forgetting); window: keep
      only the last `window` rounds (uniform weights unless decay is set too). At least one must be given.
    refit_every: rounds of a workload and regime between refits; refit_steps: decoding steps (`observe_step`
      calls) at least between two refits of a stream, so that under load (16 rows and more bring 50 rounds in
      under 4 steps) a refit's fixed cost (about 2 ms on the bundled drafter's 2,000-round window) is paid every
      few steps rather than every step. max_request_share: cap on one request's
      weight, as a share of the effective window size. max_step: largest change of any α_k or β_k per refit.
    min_rounds: effective (capped, forgetting-weighted) rounds a workload needs before its own fit is served.
    ridge: strength (in rounds) of the pull towards (α, β) = (1, 0); position_ridge: of each position's pull
      towards the correction shared by all positions (0: positions fitted independently). newton_steps: damped
      Newton steps per refit.
    workloads: labels with their own correction (None: any label, up to `max_workloads`); others pool into
      "default". sampled_temperature: which prior map a sampled round observed without a temperature used.
    """

    def __init__(self, prior: Calibration | SurvivalMap, gamma: int, *, decay: float | None = 0.995,
                 window: int | None = None, refit_every: int = 50, refit_steps: int = 8,
                 max_request_share: float = 0.1,
                 max_step: float = 0.25, min_rounds: float = 50.0, ridge: float = 1.0, position_ridge: float = 10.0,
                 newton_steps: int = 6,
                 workloads: Sequence[str] | None = None, max_workloads: int = 64,
                 sampled_temperature: float = 1.0, bins: int = DEFAULT_BINS) -> None:
        if isinstance(prior, SurvivalMap):
            prior = Calibration({0.0: prior})
        if not isinstance(prior, Calibration):
            raise TypeError(f"prior must be a Calibration or a SurvivalMap, got {type(prior).__name__}")
        if gamma < 1:
            raise ValueError(f"gamma must be ≥ 1, got {gamma}")
        if decay is None and window is None:
            raise ValueError("give decay (exponential forgetting) or window (rounds kept), or both")
        if decay is not None and not 0 < decay < 1:
            raise ValueError(f"decay must lie in (0, 1), got {decay}")
        if window is not None and window < 1:
            raise ValueError(f"window must be ≥ 1 round, got {window}")
        if refit_every < 1 or newton_steps < 1 or refit_steps < 1:
            raise ValueError("refit_every, refit_steps and newton_steps must be ≥ 1")
        if not 0 < max_request_share <= 1:
            raise ValueError(f"max_request_share must lie in (0, 1], got {max_request_share}")
        if not max_step > 0 or not ridge > 0 or position_ridge < 0 or min_rounds < 0:
            raise ValueError("max_step and ridge must be positive, position_ridge and min_rounds ≥ 0")
        self.prior = prior
        self.gamma = int(gamma)
        self.decay = decay
        self.window = window
        if window is not None:
            self.capacity = int(window)
        else:
            self.capacity = math.ceil(math.log(_MIN_WEIGHT) / math.log(decay))
        d = 1.0 if decay is None else decay
        self.effective_window = float(self.capacity) if d == 1.0 else (1 - d ** self.capacity) / (1 - d)
        self.refit_every = int(refit_every)
        self.refit_steps = int(refit_steps)
        self.max_request_share = float(max_request_share)
        self.request_cap = self.max_request_share * self.effective_window
        self.max_step = float(max_step)
        self.min_rounds = float(min_rounds)
        self.ridge = float(ridge)
        self.position_ridge = float(position_ridge)
        self.newton_steps = int(newton_steps)
        offline = frozenset(prior.workloads)  # labels with offline maps of their own are always known
        self.declared = None if workloads is None else frozenset(workloads) | {DEFAULT} | offline
        self.max_workloads = int(max_workloads)
        self.sampled_temperature = float(sampled_temperature)
        self.bins = int(bins)
        self._streams: dict[tuple[str, str], _Stream] = {}
        self._workloads: set[str] = {DEFAULT, *offline}
        self._anonymous = 0
        self._counts: Counter[str] = Counter()
        self._rejected: Counter[str] = Counter()
        self._served: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, str]] = {}
        self._maps: dict[tuple[float, str], tuple[SurvivalMap, bool]] = {}
        self._lock = threading.RLock()
        self._deferring = 0  # open deferred_refits blocks
        self._steps = 0  # `observe_step` calls so far
        self._step_block = False  # the outermost open deferred block is a step's: its refits wait `refit_steps`

    # ------------------------------------------------------------------ workloads and parameters

    def _workload_name(self, workload: str | None, create: bool) -> str:
        """The workload a label is served and fitted as ("default" for None, unknown or overflowing labels)."""
        if not isinstance(workload, str) or workload == DEFAULT:
            return DEFAULT
        if workload in self._workloads:
            return workload
        if not create or (self.declared is not None and workload not in self.declared):
            return DEFAULT
        if len(self._workloads) - 1 >= self.max_workloads:
            self._counts["overflow_labels"] += 1
            return DEFAULT
        self._workloads.add(workload)
        return workload

    def _resolve(self, workload: str | None, regime: str) -> tuple[torch.Tensor, torch.Tensor, str]:
        """(α [γ], β [γ], source) served to a workload and regime; source is "own", "default" or "prior"."""
        name = self._workload_name(workload, create=False)
        key = (name, regime)
        cached = self._served.get(key)
        if cached is not None:
            return cached
        own = self._streams.get(key)
        base = self._streams.get((DEFAULT, regime))
        if own is not None and own.trusted:
            out = (own.alpha.clone(), own.beta.clone(), "own" if name != DEFAULT else "default")
        elif base is not None and base.trusted and name not in self.prior.workload_maps:
            out = (base.alpha.clone(), base.beta.clone(), "default")
        else:
            out = (torch.ones(self.gamma, dtype=torch.float64), torch.zeros(self.gamma, dtype=torch.float64),
                   "prior")
        self._served[key] = out
        return out

    def parameters(self, workload: str | None = None) -> dict[str, Any]:
        """Per regime: the served α, β and their source, and the workload's own fit, rounds and refits."""
        with self._lock:
            name = self._workload_name(workload, create=False)
            out: dict[str, Any] = {"workload": name}
            for regime in REGIMES:
                alpha, beta, source = self._resolve(workload, regime)
                s = self._streams.get((name, regime))
                out[regime] = {
                    "alpha": alpha.tolist(), "beta": beta.tolist(), "source": source,
                    "own_alpha": None if s is None else s.alpha.tolist(),
                    "own_beta": None if s is None else s.beta.tolist(),
                    "rounds": 0 if s is None else s.rounds,
                    "effective_rounds": 0.0 if s is None else s.effective_rounds,
                    "refits": 0 if s is None else s.refits,
                    "last_change": 0.0 if s is None else s.last_change,
                }
            return out

    # ------------------------------------------------------------------ observing

    def _map_for(self, temperature: float, name: str = DEFAULT) -> tuple[SurvivalMap, bool]:
        """The prior map of a temperature and (canonical) workload name — the workload's offline map where it
        has one, else the pooled one — and whether it reads the confidence logit (channel 0)."""
        key = (temperature, name)
        hit = self._maps.get(key)
        if hit is None:
            m = self.prior.map_for(temperature, name if name in self.prior.workload_maps else None)
            hit = self._maps[key] = (m, m.reads_head)
        return hit

    def _reject(self, reason: str) -> bool:
        self._rejected[reason] += 1
        return False

    def observe(self, signals: torch.Tensor, available: int, accepted: int, greedy: bool,
                workload: str | None = None, request_id: int | None = None, pooled: bool = True,
                temperature: float | None = None) -> bool:
        """Record one verified round; True if it was stored, False if ignored or rejected (and counted).

        signals: [γ', 3] of the round's block; available: drafts in the block; accepted: drafts the target
        accepted; greedy: the request decodes greedily; pooled=False: the target's sampling applied transforms
        the drafter does not see, so the outcome says nothing about the map (ignored). temperature: the
        request's sampling temperature, choosing the prior map (default 0 if greedy, else sampled_temperature).
        Costs O(γ); refits every `refit_every` rounds of the workload and regime.
        """
        with self._lock:
            if not pooled:
                self._counts["unpooled"] += 1
                return False
            sig = self._block(signals, 2)
            if isinstance(sig, str):
                return self._reject(sig)
            return self._observe_array(sig, available, accepted, greedy, workload, request_id, temperature)

    def observe_step(self, signals: torch.Tensor, available: Sequence[int], accepted: Sequence[int],
                     greedy: Sequence[bool], workloads: Sequence[str | None] | None = None,
                     request_ids: Sequence[int | None] | None = None,
                     temperatures: Sequence[float | None] | None = None) -> int:
        """Record one decoding step's rounds, row r of signals [R, γ', 3] verifying its first available[r]
        drafts, as `observe` does each (same checks, counts and storage), with the block checked and moved to
        numpy once and the streams refitted once at the end (`deferred_refits`), a stream at most once every
        `refit_steps` calls. Returns how many were stored."""
        rows = len(available)
        others = [v for v in (workloads, request_ids, temperatures) if v is not None]
        if len(accepted) != rows or len(greedy) != rows or any(len(v) != rows for v in others):
            raise ValueError(f"observe_step: available, accepted, greedy, workloads, request_ids and temperatures "
                             f"need one entry per row ({rows})")
        with self._lock:
            block = self._block(signals, 3)
            if isinstance(block, str) or block.shape[0] != rows:
                for _ in range(rows):
                    self._reject("shape" if not isinstance(block, str) else block)
                return 0
            stored = 0
            self._steps += 1
            with self.deferred_refits(step=True):
                for r in range(rows):
                    avail = available[r]
                    cut = block[r, : avail] if isinstance(avail, (int, np.integer)) and not isinstance(avail, bool) \
                        and 0 < avail <= block.shape[1] else block[r]
                    stored += self._observe_array(
                        cut, avail, accepted[r], greedy[r], None if workloads is None else workloads[r],
                        None if request_ids is None else request_ids[r],
                        None if temperatures is None else temperatures[r])
            return stored

    def _observe_array(self, sig: np.ndarray, available: Any, accepted: Any, greedy: Any, workload: Any,
                       request_id: Any, temperature: Any) -> bool:
        """`observe` on a round's signals already checked for type and moved to numpy ([γ', 3] float32)."""
        checked = self._check(sig, available, accepted, greedy, workload, request_id, temperature)
        if isinstance(checked, str):
            return self._reject(checked)
        sig, avail, acc, t = checked
        if avail == 0:
            self._counts["empty"] += 1
            return False
        self._store(sig, avail, acc, greedy, workload, request_id, t)
        return True

    @staticmethod
    def _block(signals: Any, dims: int) -> np.ndarray | str:
        """A round's (dims 2: [γ', 3]) or a step's (dims 3: [R, γ', 3]) signals as float32 numpy, else why not."""
        if not isinstance(signals, torch.Tensor):
            return "type"
        if signals.dim() != dims or signals.shape[-1] != NUM_SIGNALS or signals.shape[-2] < 1:
            return "shape"
        if not signals.is_floating_point():
            return "type"
        return signals.detach().to(device="cpu", dtype=torch.float32).numpy()

    def _check(self, sig: np.ndarray, available: Any, accepted: Any, greedy: Any, workload: Any, request_id: Any,
               temperature: Any) -> str | tuple[np.ndarray, int, int, float]:
        """(signals [γ, 3] float32, available, accepted, temperature) of a sound round, else why it is rejected."""
        if not isinstance(greedy, bool):
            return "type"
        if workload is not None and (not isinstance(workload, str) or len(workload) > _MAX_LABEL):
            return "type"
        if request_id is not None and (isinstance(request_id, bool) or not isinstance(request_id, int)):
            return "type"
        if temperature is None:
            t = 0.0 if greedy else self.sampled_temperature
        elif isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not math.isfinite(temperature) or temperature < 0:
            return "type"
        else:
            t = float(temperature)
        counts = []
        for v in (available, accepted):
            if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point() and v.dtype != torch.bool:
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                return "type"
            counts.append(int(v))
        avail, acc = counts
        if avail < 0 or acc < 0:
            return "negative"
        if acc > avail:
            return "accepted>available"
        if avail > sig.shape[0]:
            return "available>signals"
        if np.isinf(sig).any():
            return "nonfinite"
        g = min(sig.shape[0], self.gamma)
        avail, acc = min(avail, g), min(acc, g)
        if self._map_for(t, self._workload_name(workload, create=False))[1] \
                and np.isnan(sig[:avail, CONF_LOGIT]).any():
            return "nonfinite"
        if sig.shape[0] != self.gamma:
            pad = np.full((self.gamma, NUM_SIGNALS), np.nan, dtype=np.float32)
            pad[:g] = sig[:g]
            sig = pad
        return sig, avail, acc, t

    def _store(self, signals: np.ndarray, available: int, accepted: int, greedy: bool, workload: str | None,
               request_id: int | None, temperature: float) -> None:
        name = self._workload_name(workload, create=True)
        regime = REGIMES[0] if greedy else REGIMES[1]
        stream = self._streams.get((name, regime))
        if stream is None:
            stream = self._streams[(name, regime)] = _Stream(self.gamma, self.capacity, name)
        if request_id is None:
            self._anonymous += 1
            request = -self._anonymous
        else:
            request = int(request_id) & 0x7FFF_FFFF_FFFF_FFFF  # non-negative, apart from anonymous ids
        stream.insert(signals, available, accepted, request, temperature)
        self._counts["observed"] += 1
        if stream.since_refit >= self.refit_every and not self._deferring:
            self._refit(stream)
            self._served.clear()

    @contextmanager
    def deferred_refits(self, step: bool = False) -> Iterator[None]:
        """Rounds observed inside the block refit their streams once, when it ends, rather than every
        `refit_every` rounds within it: a decoding step observes all its rows' rounds in one such block, so
        a stream refits at most once per step however many rows it has (at 32 rows and refit_every 25 it
        would otherwise refit more than once in some steps, for no gain before the next step's survivals).
        Blocks nest; survival asked inside one sees the parameters of before it. `step`: the block is a decoding
        step's (`observe_step`); when it is the outermost, a stream refits only `refit_steps` steps or more after
        its last refit."""
        with self._lock:
            if not self._deferring:
                self._step_block = step
            self._deferring += 1
            try:
                yield
            finally:
                self._deferring -= 1
                if not self._deferring:
                    due = [s for s in self._streams.values() if s.since_refit >= self.refit_every
                           and (not self._step_block or self._steps - s.refit_step >= self.refit_steps)]
                    for stream in due:
                        self._refit(stream)
                    if due:
                        self._served.clear()

    def observe_records(self, records: RoundRecords, workload: str | None = None,
                        request_ids: Sequence[int | None] | None = None, pooled: bool = True,
                        temperature: float | None = None) -> int:
        """Observe every round of `records` in order (as `observe`); returns how many were stored."""
        if request_ids is not None and len(request_ids) != len(records):
            raise ValueError(f"{len(request_ids)} request ids for {len(records)} rounds")
        stored = 0
        for i in range(len(records)):
            stored += self.observe(records.signals[i], int(records.available[i]), int(records.accepted[i]),
                                   bool(records.greedy[i]), workload,
                                   None if request_ids is None else request_ids[i], pooled, temperature)
        return stored

    # ------------------------------------------------------------------ fitting

    def _sync(self, stream: _Stream) -> None:
        """Compute the prior's conditional logits of the stream's new rounds in one batch per prior map.

        A round whose logits come out non-finite where they count is dropped (available set to 0) and counted.
        """
        if not stream.pending:
            return
        slots = stream.pending_slots()
        stream.pending = 0
        groups: dict[int, tuple[SurvivalMap, list[int]]] = {}
        for slot in slots.tolist():
            m = self._map_for(float(stream.temperature[slot]), stream.workload)[0]
            groups.setdefault(id(m), (m, []))[1].append(slot)
        k = np.arange(1, self.gamma + 1)[None, :]
        for m, members in groups.values():
            idx = np.asarray(members)
            avail = torch.from_numpy(stream.available[idx])
            sig = fill_unavailable(torch.from_numpy(stream.signals[idx]), avail)
            try:
                z = _logit(m.conditional(sig)).numpy()
            except (ValueError, RuntimeError):  # cannot happen after _check; drop the whole batch if it does
                z = np.full((len(idx), self.gamma), np.nan)
            inside = k <= stream.available[idx][:, None]
            bad = ~np.isfinite(np.where(inside, z, 0.0)).all(1)
            stream.z[idx] = np.where(inside & ~bad[:, None], z, 0.0)
            if bad.any():
                stream.available[idx[bad]] = 0
                self._rejected["prior"] += int(bad.sum())

    def _window(self, stream: _Stream) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(z [n, γ] float64, available [n], accepted [n], capped weights [n]) of the stream's window.

        Weights: decay^age (or 1 in a plain window), then each request's total capped at `request_cap`.
        """
        self._sync(stream)
        n = stream.filled()
        age = stream.rounds - 1 - stream.time[:n]
        w = np.ones(n) if self.decay is None else np.power(self.decay, age.astype(np.float64))
        w = w * (stream.available[:n] > 0)
        _, inverse = np.unique(stream.request[:n], return_inverse=True)
        per_request = np.bincount(inverse, weights=w)
        scale = np.minimum(1.0, self.request_cap / np.maximum(per_request, 1e-300))
        w = w * scale[inverse]
        return (torch.from_numpy(stream.z[:n].copy()), torch.from_numpy(stream.available[:n].copy()),
                torch.from_numpy(stream.accepted[:n].copy()), torch.from_numpy(w))

    def _newton(self, x: torch.Tensor, y: torch.Tensor, wv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                centers: Sequence[tuple[float, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per column p of x [n, P]: (α_p, β_p) minimising Σ_i wv·logloss(y, sigmoid(α x + β)) + Σ_c ½λ_c‖θ − c‖².

        Damped Newton from (a, b), every column at once (2×2 systems), halving a column's step while its
        loss would rise. A step that moves no column's logits α x + β by more than `_FULL_STEP` is taken
        whole without that check (near the optimum, where refits that start from the last one are, the
        loss is close to its quadratic model there). centers: (λ, α centre [P], β centre [P]) ridge terms.
        """
        lam = sum(c[0] for c in centers)
        reach = x.abs().amax(0) if x.shape[0] else torch.zeros(x.shape[1], dtype=x.dtype)

        def loss(a_: torch.Tensor, b_: torch.Tensor) -> torch.Tensor:
            s = a_ * x + b_
            out = (wv * (torch.nn.functional.softplus(s) - y * s)).sum(0)
            for weight, ca, cb in centers:
                out = out + 0.5 * weight * ((a_ - ca) ** 2 + (b_ - cb) ** 2)
            return out

        current = None
        for _ in range(self.newton_steps):
            p = torch.sigmoid(a * x + b)
            r = wv * (p - y)
            g_a = (r * x).sum(0) + sum(weight * (a - ca) for weight, ca, _ in centers)
            g_b = r.sum(0) + sum(weight * (b - cb) for weight, _, cb in centers)
            h = wv * p * (1 - p)
            hx = h * x
            h_aa = (hx * x).sum(0) + lam
            h_ab = hx.sum(0)
            h_bb = h.sum(0) + lam
            det = h_aa * h_bb - h_ab * h_ab
            d_a = (h_bb * g_a - h_ab * g_b) / det
            d_b = (h_aa * g_b - h_ab * g_a) / det
            if float((d_a.abs() * reach + d_b.abs()).max()) <= _FULL_STEP:
                a, b, current = a - d_a, b - d_b, None
                step = torch.ones_like(a)
            else:
                current = loss(a, b) if current is None else current
                step = torch.ones_like(a)
                for _ in range(8):
                    trial = loss(a - step * d_a, b - step * d_b)
                    ok = trial <= current + 1e-9 * current.abs().clamp_min(1.0)
                    if bool(ok.all()):
                        break
                    step = torch.where(ok, step, step / 2)
                a = torch.where(ok, a - step * d_a, a)
                b = torch.where(ok, b - step * d_b, b)
                current = torch.where(ok, trial, current)
                step = torch.where(ok, step, torch.zeros_like(step))
            if float(torch.maximum((step * d_a).abs(), (step * d_b).abs()).max()) < 1e-6:  # quadratic: error ~1e-12
                break
        return a, b

    def _refit(self, stream: _Stream) -> None:
        """Fit every position's (α_k, β_k) on the window, then move the served ones by at most max_step.

        Two vectorised stages: a correction shared by all positions (ridge `ridge` towards (1, 0)), then each
        position's (ridge `ridge` towards (1, 0) plus `position_ridge` towards the shared one, which lends
        deep, rarely reached positions the strength of the others).
        """
        stream.since_refit, stream.refit_step = 0, self._steps
        z, avail, acc, w = self._window(stream)
        stream.effective_rounds = float(w.sum())
        stream.trusted = stream.effective_rounds >= self.min_rounds
        k = torch.arange(1, self.gamma + 1).view(1, -1)
        valid = (k <= avail.view(-1, 1)) & (acc.view(-1, 1) >= k - 1)
        y = (acc.view(-1, 1) >= k).to(torch.float64)
        wv = w.view(-1, 1) * valid
        x = z * valid
        one, zero = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        prior_center = (self.ridge, one, zero)
        # Newton starts from the last refit's optimum: a window that moved by `refit_every` rounds moves the
        # optimum little, so a few steps reach it (the minimum is unique: where it starts changes no result)
        last = stream.optimum
        shared_a = shared_b = None
        if self.position_ridge > 0:
            start = (stream.alpha.mean().view(1), stream.beta.mean().view(1)) if last is None else last[:2]
            keep = wv.reshape(-1) > 0  # entries of no weight add nothing to the loss
            shared_a, shared_b = self._newton(x.reshape(-1, 1)[keep], y.reshape(-1, 1)[keep],
                                              wv.reshape(-1, 1)[keep], *start, [prior_center])
            centers = [prior_center, (self.position_ridge, shared_a, shared_b)]
        else:
            centers = [prior_center]
        start = (stream.alpha.clone(), stream.beta.clone()) if last is None else last[2:]
        a, b = self._newton(x, y, wv, *start, centers)
        fits = (shared_a, shared_b, a, b)  # kept as the next start only when finite: a bad start would stick
        stream.optimum = fits if all(t is None or bool(torch.isfinite(t).all()) for t in fits) else None
        new_a = (stream.alpha + (a - stream.alpha).clamp(-self.max_step, self.max_step)).clamp(*_ALPHA_BOUNDS)
        new_b = (stream.beta + (b - stream.beta).clamp(-self.max_step, self.max_step)).clamp(*_BETA_BOUNDS)
        if not (bool(torch.isfinite(new_a).all()) and bool(torch.isfinite(new_b).all())):
            self._rejected["refit"] += 1  # should never happen; the old parameters stay
            return
        stream.last_change = float(torch.maximum((new_a - stream.alpha).abs(), (new_b - stream.beta).abs()).max())
        stream.alpha, stream.beta = new_a, new_b
        stream.refits += 1

    def refit(self, workload: str | None = None) -> None:
        """Refit a workload's streams now (normally every `refit_every` rounds); moves are still bounded."""
        with self._lock:
            name = self._workload_name(workload, create=False)
            for regime in REGIMES:
                s = self._streams.get((name, regime))
                if s is not None and s.filled():
                    self._refit(s)
            self._served.clear()

    # ------------------------------------------------------------------ serving

    def survival(self, signals: torch.Tensor, available: torch.Tensor,
                 temperatures: Sequence[float] | torch.Tensor,
                 workloads: Sequence[str | None] | None = None) -> torch.Tensor:
        """Corrected cumulative survival [R, γ] (zero past available), as `Calibration.survival` per workload.

        Reads only the signals (non-anticipating). Rows whose correction is the identity get exactly the
        prior's survival.
        """
        if signals.dim() != 3:
            raise ValueError(f"signals must be [R, γ, 3], got {list(signals.shape)}")
        temps = temperatures.tolist() if isinstance(temperatures, torch.Tensor) else [float(t) for t in temperatures]
        rows, gamma = signals.shape[:2]
        names = [None] * rows if workloads is None else list(workloads)
        if len(temps) != rows or len(names) != rows:
            raise ValueError(f"{len(temps)} temperatures and {len(names)} workloads for {rows} rows")
        keys: dict[tuple[str | None, float], int] = {}
        index = [keys.setdefault((w, t), len(keys)) for t, w in zip(temps, names)]
        with self._lock:
            resolved = [self._resolve(w, REGIMES[0] if t <= 0 else REGIMES[1]) for w, t in keys]
            canonical = [self._workload_name(w, create=False) for w, _ in keys]
            maps = [self._map_for(t, name)[0] for name, (_, t) in zip(canonical, keys)]
        if all(src == "prior" for *_, src in resolved):
            rows_prior = [canonical[i] if canonical[i] in self.prior.workload_maps else None for i in index]
            return self.prior.survival(signals, available, temps, rows_prior)
        avail = available.to("cpu")
        sig = fill_unavailable(signals, available)
        if len(keys) == 1:  # every row shares one map and correction: no gathering
            c = self._corrected(maps[0], resolved[0], sig, gamma)
        else:
            c = torch.empty(signals.shape[:2], dtype=signals.dtype if signals.is_floating_point() else torch.float32,
                            device=signals.device)
            for i in range(len(keys)):
                members = torch.tensor([r for r, j in enumerate(index) if j == i], dtype=torch.long,
                                       device=signals.device)
                c[members] = self._corrected(maps[i], resolved[i], sig[members], gamma).to(c.dtype)
        k = torch.arange(1, gamma + 1, device=signals.device).view(1, -1)
        return torch.cumprod(c, dim=1).masked_fill_(k > avail.to(signals.device).view(-1, 1), 0.0)

    @staticmethod
    def _corrected(prior: SurvivalMap, resolved: tuple[torch.Tensor, torch.Tensor, str], signals: torch.Tensor,
                   gamma: int) -> torch.Tensor:
        """Conditional survival [n, γ] of rows sharing a prior map and a served (α, β, source)."""
        c = prior.conditional(signals)
        alpha, beta, source = resolved
        if source == "prior":  # the identity: exactly the prior's
            return c
        c = c if c.is_floating_point() else c.float()
        z = _logit(c)
        corrected = torch.sigmoid(_extend(alpha, gamma).to(z.device) * z + _extend(beta, gamma).to(z.device))
        return corrected.clamp(_EPS, 1 - _EPS).to(c.dtype)

    def _served_survival(self, workload: str | None, regime: str, z: torch.Tensor,
                                    available: torch.Tensor) -> torch.Tensor:
        """Cumulative survival [n, γ] float64 served to a workload from prior logits z [n, γ]."""
        with self._lock:
            alpha, beta, _ = self._resolve(workload, regime)
        c = torch.sigmoid(_extend(alpha, z.shape[1]) * z + _extend(beta, z.shape[1])).clamp(_EPS, 1 - _EPS)
        k = torch.arange(1, z.shape[1] + 1).view(1, -1)
        return torch.cumprod(c, dim=1).masked_fill_(k > available.view(-1, 1), 0.0)

    # ------------------------------------------------------------------ metrics

    def ece(self, workload: str | None = None, regime: str | None = None) -> float:
        """ECE (`bins` bins) of the served cumulative survival on the workload's forgetting window, pooled over
        positions (and over regimes unless one is named); NaN without data."""
        with self._lock:
            name = self._workload_name(workload, create=False)
            preds, labels, weights = [], [], []
            for reg in REGIMES if regime is None else (regime,):
                s = self._streams.get((name, reg))
                if s is None or not s.filled():
                    continue
                z, avail, acc, w = self._window(s)
                a = self._served_survival(name, reg, z, avail)
                k = torch.arange(1, self.gamma + 1).view(1, -1)
                valid = k <= avail.view(-1, 1)
                preds.append(a[valid])
                labels.append((acc.view(-1, 1) >= k).to(torch.float64)[valid])
                weights.append(w.view(-1, 1).expand_as(a)[valid])
        if not preds:
            return math.nan
        return weighted_ece(torch.cat(preds), torch.cat(labels), torch.cat(weights), self.bins)

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready counters, settings and per-workload parameters and ECE, for metrics endpoints."""
        with self._lock:
            workloads = {}
            for name in sorted(self._workloads):
                if any((name, r) in self._streams for r in REGIMES) or name == DEFAULT:
                    workloads[name] = {**self.parameters(name), "ece": self.ece(name)}
            return json_safe({
                "settings": {"gamma": self.gamma, "decay": self.decay, "window": self.window,
                             "capacity": self.capacity, "effective_window": self.effective_window,
                             "refit_every": self.refit_every, "refit_steps": self.refit_steps,
                             "max_request_share": self.max_request_share,
                             "request_cap": self.request_cap, "max_step": self.max_step,
                             "min_rounds": self.min_rounds, "ridge": self.ridge,
                             "position_ridge": self.position_ridge},
                "counts": {"observed": self._counts["observed"], "unpooled": self._counts["unpooled"],
                           "empty": self._counts["empty"], "overflow_labels": self._counts["overflow_labels"],
                           "rejected": sum(v for k, v in self._rejected.items() if k != "refit")},
                "rejected": dict(self._rejected),
                "workloads": workloads,
            })

    @property
    def rejected(self) -> dict[str, int]:
        """Rejected rounds by reason."""
        return dict(self._rejected)

    @property
    def counts(self) -> dict[str, int]:
        """observed / unpooled / empty / overflow_labels counters."""
        return dict(self._counts)
