"""Trace-driven simulation of verification schedulers at any concurrency and on any cost curve.

A trace records, per request, every round of a decode that verified the whole draft block: the block's
survival signals, how many drafts it offered (`available`) and how many the target accepted (`accepted`).
Acceptance is decided prefix by prefix, so a round verified with ℓ drafts would have accepted
min(ℓ, accepted): `simulate` replays traces under any scheduler (`dspark.scheduling`) and cost model
without running a model, which lets a CPU-recorded trace answer how a policy behaves at 512 concurrent
requests on a GPU-shaped cost curve (`gpu_cost_model`).
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.atomic import read_json, save_figure_atomic, write_text_atomic
from dspark.calibration.signals import CONF_LOGIT, NUM_SIGNALS
from dspark.scheduling import CostModel, Scheduler, step_tokens

TRACE_FORMAT = "dspark-trace"
TRACE_VERSION = 1
DEFAULT_CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


# ------------------------------------------------------------------------------------------------------
# traces


@dataclass
class TraceRequest:
    """The rounds of one request, columnar: round i offered available[i] drafts and accepted[i] of them.

    signals: float32 [rounds, γ, 3] (NaN past available[i] and where a signal does not exist);
    tokens: tokens the request committed in the trace (its length when replayed).
    """

    signals: np.ndarray
    available: np.ndarray
    accepted: np.ndarray
    tokens: int

    def __post_init__(self) -> None:
        self.signals = np.asarray(self.signals, dtype=np.float32)
        self.available = np.asarray(self.available, dtype=np.int64).reshape(-1)
        self.accepted = np.asarray(self.accepted, dtype=np.int64).reshape(-1)
        n = len(self.available)
        if n == 0:
            raise ValueError("a trace request needs at least one round")
        if self.signals.ndim != 3 or self.signals.shape[0] != n or self.signals.shape[2] != NUM_SIGNALS:
            raise ValueError(f"signals must be [{n}, γ, {NUM_SIGNALS}], got {list(self.signals.shape)}")
        if self.accepted.shape != (n,):
            raise ValueError(f"accepted has {len(self.accepted)} rounds but available has {n}")
        gamma = self.signals.shape[1]
        if (self.available < 0).any() or (self.available > gamma).any():
            raise ValueError(f"available must lie in [0, {gamma}], got {self.available.tolist()}")
        if (self.accepted < 0).any() or (self.accepted > self.available).any():
            raise ValueError(f"accepted must lie in [0, available], got {self.accepted.tolist()}")
        if int(self.tokens) < 1:
            raise ValueError(f"tokens must be a positive count, got {self.tokens}")
        self.tokens = int(self.tokens)

    @classmethod
    def build(cls, accepted: Sequence[int], available: Sequence[int] | int | None = None, gamma: int | None = None,
              signals: np.ndarray | None = None, tokens: int | None = None) -> TraceRequest:
        """A request from per-round accepted counts (tests, synthetic traces).

        available defaults to γ every round (γ: `gamma`, else the signals' width, else max(accepted));
        signals default to NaN; tokens to Σ(accepted + 1), what verifying every whole block commits.
        """
        acc = np.asarray(accepted, dtype=np.int64).reshape(-1)
        if gamma is None:
            if signals is not None:
                gamma = signals.shape[1]
            else:
                gamma = int(max(acc.max(initial=0), np.max(available) if available is not None else 0))
        avail = np.full(len(acc), gamma, dtype=np.int64) if available is None else np.broadcast_to(
            np.asarray(available, dtype=np.int64), acc.shape).copy()
        sig = np.full((len(acc), gamma, NUM_SIGNALS), np.nan, np.float32) if signals is None else signals
        return cls(sig, avail, acc, int((acc + 1).sum()) if tokens is None else tokens)

    @property
    def num_rounds(self) -> int:
        """Rounds recorded."""
        return len(self.available)

    @property
    def rounds(self) -> list[tuple[np.ndarray, int, int]]:
        """The rounds as (signals [γ, 3], available, accepted), in order."""
        return [(self.signals[i], int(self.available[i]), int(self.accepted[i])) for i in range(self.num_rounds)]


@dataclass
class Trace:
    """Recorded requests of one drafter on one domain at one sampling temperature (block width γ)."""

    requests: list[TraceRequest]
    temperature: float
    gamma: int
    domain: str = ""
    drafter: str = ""

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("a trace needs at least one request")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        widths = {r.signals.shape[1] for r in self.requests}
        if widths != {int(self.gamma)}:
            raise ValueError(f"trace gamma is {self.gamma} but its requests have signal widths {sorted(widths)}")
        self.gamma = int(self.gamma)
        self.temperature = float(self.temperature)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def tau(self) -> float:
        """τ of the recorded decode: committed tokens per round with the whole block verified."""
        return sum(r.tokens for r in self.requests) / max(1, sum(r.num_rounds for r in self.requests))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready layout (NaN signals as null; only the first `available` signal rows of each round)."""
        def rows(sig: np.ndarray, n: int) -> list[list[float | None]]:
            return [[None if math.isnan(v) else float(v) for v in row] for row in sig[:n].tolist()]

        return {"format": TRACE_FORMAT, "version": TRACE_VERSION, "temperature": self.temperature,
                "gamma": self.gamma, "domain": self.domain, "drafter": self.drafter,
                "requests": [{"tokens": r.tokens, "available": r.available.tolist(), "accepted": r.accepted.tolist(),
                              "signals": [rows(s, a) for s, a in zip(r.signals, r.available.tolist())]}
                             for r in self.requests]}

    def save(self, path: str | Path) -> Path:
        """Write the trace as JSON atomically (temporary file in the same folder, then os.replace)."""
        return write_text_atomic(path, json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False))

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> Trace:
        """Validate and rebuild a trace; ValueError names `source` and the offending field."""
        def fail(field: str, msg: str) -> ValueError:
            return ValueError(f"trace file {source}: field '{field}' {msg}")

        if not isinstance(data, Mapping):
            raise ValueError(f"trace file {source}: top level must be a JSON object, got {type(data).__name__}")  # noqa: TRY004
        if data.get("format") != TRACE_FORMAT:
            raise fail("format", f"must be {TRACE_FORMAT!r}, got {data.get('format')!r}")
        if data.get("version") != TRACE_VERSION:
            raise fail("version", f"must be {TRACE_VERSION}, got {data.get('version')!r}")
        gamma, temp = data.get("gamma"), data.get("temperature")
        if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 0:
            raise fail("gamma", f"must be a non-negative integer, got {gamma!r}")
        if not isinstance(temp, (int, float)) or isinstance(temp, bool) or not math.isfinite(temp) or temp < 0:
            raise fail("temperature", f"must be a finite number >= 0, got {temp!r}")
        for name in ("domain", "drafter"):
            if not isinstance(data.get(name, ""), str):
                raise fail(name, f"must be a string, got {data.get(name)!r}")
        raw = data.get("requests")
        if not isinstance(raw, list) or not raw:
            raise fail("requests", "must be a non-empty list")
        requests = []
        for i, req in enumerate(raw):
            where = f"requests[{i}]"
            if not isinstance(req, Mapping):
                raise fail(where, "must be an object")
            cols = {}
            for name in ("available", "accepted"):
                col = req.get(name)
                if not isinstance(col, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in col):
                    raise fail(f"{where}.{name}", f"must be a list of integers, got {col!r:.60}")
                cols[name] = col
            tokens = req.get("tokens")
            if not isinstance(tokens, int) or isinstance(tokens, bool):
                raise fail(f"{where}.tokens", f"must be an integer, got {tokens!r}")
            sig_rows = req.get("signals")
            n = len(cols["available"])
            if not isinstance(sig_rows, list) or len(sig_rows) != n:
                raise fail(f"{where}.signals", f"must be a list of {n} rounds")
            sig = np.full((n, gamma, NUM_SIGNALS), np.nan, np.float32)
            for k, rows in enumerate(sig_rows):
                ok = isinstance(rows, list) and len(rows) <= gamma and all(
                    isinstance(row, list) and len(row) == NUM_SIGNALS
                    and all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in row)
                    for row in rows)
                if not ok:
                    raise fail(f"{where}.signals[{k}]", f"must be at most {gamma} rows of {NUM_SIGNALS} numbers or null")
                if rows:
                    sig[k, : len(rows)] = np.array([[np.nan if v is None else v for v in row] for row in rows])
            try:
                requests.append(TraceRequest(sig, cols["available"], cols["accepted"], tokens))
            except ValueError as err:
                raise fail(where, f"is malformed: {err}") from None
        return cls(requests, float(temp), gamma, data.get("domain", ""), data.get("drafter", ""))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace written by `save`; a missing, truncated or malformed file raises ValueError naming it."""
        return cls.from_dict(read_json(path, "trace file"), str(path))


def trace_from_results(results, gamma: int, temperature: float, domain: str = "", drafter: str = "") -> Trace:
    """A trace from `decode` results run with scheduler "fixed" and record_signals=True."""
    requests = []
    for i, res in enumerate(results):
        n = len(res.rounds)
        sig = np.full((n, gamma, NUM_SIGNALS), np.nan, np.float32)
        avail, acc = np.zeros(n, np.int64), np.zeros(n, np.int64)
        for k, s in enumerate(res.rounds):
            a = s.draft_len if s.available is None else s.available
            if s.draft_len != a:
                raise ValueError(f"request {i} round {k} verified {s.draft_len} of {a} drafts: a trace needs "
                                 f"every whole block verified (scheduler 'fixed')")
            avail[k], acc[k] = a, s.accepted
            if s.signals:
                sig[k, : len(s.signals)] = np.asarray(s.signals, dtype=np.float32)
        requests.append(TraceRequest(sig, avail, acc, max(1, len(res.token_ids))))
    return Trace(requests, temperature, gamma, domain, drafter)


def record_trace(target, drafter, prompts: list[list[int]], temperature: float, max_new_tokens: int,
                 batch_size: int = 8, domain: str = "", seed: int = 0) -> Trace:
    """Decode token-id prompts verifying every whole block (scheduler "fixed") and record the rounds.

    Prompts run in batches of `batch_size`; request i samples with seed + i.
    """
    from dspark.decoding import decode, drafter_gamma
    from dspark.sampling import SamplingParams

    gamma = drafter_gamma(drafter)
    if gamma <= 0:
        raise ValueError("a trace needs a drafter that proposes drafts (got one with γ = 0)")
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    results = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start: start + batch_size]
        params = [SamplingParams(temperature=temperature, seed=seed + start + i) for i in range(len(chunk))]
        results += decode(target, drafter, chunk, params, max_new_tokens, scheduler="fixed", record_signals=True)
    name = getattr(drafter, "name", "") or type(drafter).__name__
    return trace_from_results(results, gamma, temperature, domain, name)


# ------------------------------------------------------------------------------------------------------
# simulation


@dataclass
class SimResult:
    """What one simulated run delivered.

    tokens_per_s: all committed tokens over all simulated seconds. per_user_median / per_user_p10: over
    finished requests, a request's tokens over the summed seconds of the steps it took part in (NaN when
    none finished). verified_per_step / wasted_per_step: drafts sent to the target per step, and those of
    them rejected, averaged over all steps. tau: tokens committed per request per step (1 without drafting).
    draft_share: share of steps that drafted.
    """

    scheduler: str
    concurrency: int
    steps: int
    seconds: float
    tokens: int
    tokens_per_s: float
    per_user_median: float
    per_user_p10: float
    verified_per_step: float
    wasted_per_step: float
    tau: float
    draft_share: float
    finished: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (NaN as None)."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


class OutcomeOracle:
    """A survival "map" for the simulator only: 1 for the drafts a round's full block had accepted, 0 after.

    It reads the outcome, so it anticipates by construction: no scheduler may use it. Replayed under a
    scheduler it bounds what any survival estimate could give that scheduler (the distance from the
    calibrated estimate's figure is what sharper confidences could still win)."""


class _Pool:
    """All requests of a list of traces flattened for vectorised replay, with each round's survival."""

    def __init__(self, traces: Sequence[Trace], survival_map: Any) -> None:
        if isinstance(traces, Trace):
            traces = [traces]
        if not traces:
            raise ValueError("no traces to simulate")
        self.gamma = max(t.gamma for t in traces)
        reqs = [(t, r) for t in traces for r in t.requests]
        self.rounds = np.array([r.num_rounds for _, r in reqs], dtype=np.int64)
        self.offset = np.concatenate([[0], np.cumsum(self.rounds)[:-1]]).astype(np.int64)
        self.tokens = np.array([r.tokens for _, r in reqs], dtype=np.int64)
        self.available = np.concatenate([r.available for _, r in reqs])
        self.accepted = np.concatenate([r.accepted for _, r in reqs])
        if isinstance(survival_map, OutcomeOracle):
            self.survival = (np.arange(self.gamma)[None, :] < self.accepted[:, None]).astype(np.float64)
            return
        parts = []
        for t in traces:
            sig = np.concatenate([r.signals for r in t.requests])
            avail = np.concatenate([r.available for r in t.requests])
            a = _survival(survival_map, sig, avail, t.temperature) if t.gamma else np.zeros((len(avail), 0))
            parts.append(np.pad(a, ((0, 0), (0, self.gamma - t.gamma))))
        self.survival = np.concatenate(parts)

    def __len__(self) -> int:
        return len(self.rounds)


def _survival(survival_map: Any, signals: np.ndarray, available: np.ndarray, temperature: float) -> np.ndarray:
    """Cumulative survival [n, γ] of recorded rounds (zero past available) from a map or a `Calibration`."""
    n, gamma, _ = signals.shape
    beyond = np.arange(gamma)[None, :] >= available[:, None]
    sig = signals.copy()
    sig[beyond] = 0.0  # masked to zero survival below; finite so that maps needing a signal accept the row
    if survival_map is None:
        from dspark.calibration.maps import default_map

        has_head = bool(np.isfinite(signals[..., CONF_LOGIT][~beyond]).any())
        survival_map = default_map(has_head, gamma)
    s, av = torch.from_numpy(sig), torch.from_numpy(available)
    if hasattr(survival_map, "map_for"):  # a Calibration: one map per sampling temperature
        out = survival_map.survival(s, av, [temperature] * n)
    else:
        out = survival_map.survival(s, av)
    a = out.detach().cpu().double().numpy() if isinstance(out, torch.Tensor) else np.asarray(out, dtype=np.float64)
    if a.shape != (n, gamma):
        raise ValueError(f"survival map returned shape {list(a.shape)} for {n} rounds of width {gamma}")
    a = np.where(beyond, 0.0, np.nan_to_num(a, nan=0.0))
    return a


class _Dealer:
    """Hands out request indices: a seeded permutation of the pool, a fresh one each pass."""

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.rng = np.random.default_rng(seed)
        self.queue: list[int] = []

    def next(self) -> int:
        if not self.queue:
            self.queue = self.rng.permutation(self.size).tolist()[::-1]
        return self.queue.pop()


def simulate(traces: Trace | Sequence[Trace], scheduler_spec: str | Scheduler, cost: CostModel, survival_map: Any = None,
             concurrency: int = 1, steps: int | None = None, seed: int = 0,
             token_budget: int | None = None) -> SimResult:
    """Replay traces under a scheduler with `concurrency` request slots (a closed loop) on a cost model.

    Each slot replays a request drawn from the pooled traces (a seeded permutation, reshuffled each pass;
    requests are reused when there are fewer of them than slots). Per step, with B = concurrency:
    if the scheduler wants drafts, each request's current round gets survival from `survival_map` (a
    `SurvivalMap`, or a `Calibration` read at the trace's temperature; None: the uncalibrated default) cut
    to its limit min(available, tokens left − 1), `Scheduler.plan` picks lengths ℓ, the request accepts
    min(ℓ, A) of the round's A accepted drafts and commits that + 1; the step costs
    cost.cost(B, step_tokens(ℓ, cost.layout)) and every round pointer advances. Otherwise (scheduler
    "none", an adaptive policy backing off, nothing left to draft) every request commits 1 token, the step
    costs cost.plain_cost(B) and the round pointers stay, but for rounds that offered no drafts (each request's
    first round, whose token the prefill sampled): those were plain rounds, and the step consumes them. A
    request finishes once it has committed as many tokens as in its trace; a new request takes its slot from
    the next step.

    Assumptions: acceptance is prefix-wise, so a verified prefix of ℓ accepts min(ℓ, A); later rounds do
    not depend on the chosen ℓ (the next round's draft quality is the trace's next round, whatever the
    text position); a request that needs more rounds than its trace holds replays its rounds again from
    the first; step costs depend only on (B, N) and carry no prefill cost; the drafter's γ is the traces'.

    scheduler_spec: a policy name (a fresh `Scheduler` per call) or a `Scheduler`, used as is (its
    state carries over between calls). steps: steps to run; None runs until 2·max(requests,
    concurrency) requests have finished.
    """
    return _simulate(_Pool(traces, survival_map), scheduler_spec, cost, concurrency, steps, seed, token_budget)


def _simulate(pool: _Pool, spec: str | Scheduler, cost: CostModel, concurrency: int, steps: int | None, seed: int,
              token_budget: int | None) -> SimResult:
    if concurrency < 1:
        raise ValueError(f"concurrency must be a positive integer, got {concurrency}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be a positive integer or None, got {steps}")
    sched = spec if isinstance(spec, Scheduler) else Scheduler(spec, pool.gamma)
    if sched.needs_cost and cost is None:
        raise ValueError(f"scheduler {sched.spec!r} needs a cost model")
    num = int(concurrency)
    dealer = _Dealer(len(pool), seed)
    req = np.array([dealer.next() for _ in range(num)], dtype=np.int64)
    ptr = np.zeros(num, dtype=np.int64)
    done = np.zeros(num, dtype=np.int64)
    busy = np.zeros(num, dtype=np.float64)
    serial = np.arange(num, dtype=np.int64)
    next_serial = num
    positions = np.arange(pool.gamma)[None, :]
    target_finished = 2 * max(len(pool), num) if steps is None else None
    finished_rates: list[float] = []
    total_tokens, total_seconds, drafted_steps, verified, wasted, step = 0, 0.0, 0, 0, 0, 0
    while (step < steps) if steps is not None else (len(finished_rates) < target_finished):
        g = pool.offset[req] + ptr
        remaining = pool.tokens[req] - done
        limits = np.maximum(0, np.minimum(pool.available[g], remaining - 1))
        drafted = pool.gamma > 0 and int(limits.max()) > 0 and sched.wants_drafts(num)
        if drafted:
            surv = pool.survival[g] * (positions < limits[:, None]) if sched.needs_survival else None
            plan = sched.plan(surv, limits, cost, token_budget, serial.tolist())
            lens = np.minimum(np.asarray(plan.lengths, dtype=np.int64), limits)
            acc = np.minimum(lens, pool.accepted[g])
            commit = acc + 1
            seconds = cost.cost(num, step_tokens(lens, cost.layout))
            ptr = (ptr + 1) % pool.rounds[req]
            drafted_steps += 1
            verified += int(lens.sum())
            wasted += int((lens - acc).sum())
        else:
            commit = np.ones(num, dtype=np.int64)
            seconds = cost.plain_cost(num)
            # a round that offered no drafts (each request's first, the prefill's token) was a plain round:
            # this step is it; the others keep their drafts for the next drafted step
            ptr = np.where(pool.available[g] == 0, (ptr + 1) % pool.rounds[req], ptr)
        commit = np.minimum(commit, remaining)
        done += commit
        busy += seconds
        total_tokens += int(commit.sum())
        total_seconds += seconds
        step += 1
        for s in np.nonzero(done >= pool.tokens[req])[0]:
            finished_rates.append(float(done[s] / busy[s]))
            req[s], ptr[s], done[s], busy[s], serial[s] = dealer.next(), 0, 0, 0.0, next_serial
            next_serial += 1
    rates = np.array(finished_rates)
    return SimResult(
        scheduler=sched.spec, concurrency=num, steps=step, seconds=total_seconds, tokens=total_tokens,
        tokens_per_s=total_tokens / total_seconds,
        per_user_median=float(np.median(rates)) if len(rates) else math.nan,
        per_user_p10=float(np.percentile(rates, 10)) if len(rates) else math.nan,
        verified_per_step=verified / step, wasted_per_step=wasted / step,
        tau=total_tokens / (step * num), draft_share=drafted_steps / step, finished=len(rates))


# ------------------------------------------------------------------------------------------------------
# GPU-shaped cost curves


def gpu_cost_model(spec: Mapping[str, Any], max_drafts: int = 8) -> CostModel:
    """A `CostModel` shaped like a CUDA-graph serving engine's step time, from a JSON-style spec (ms).

    The target pass over N query tokens pads N up to the next captured graph size g(N) and costs
    base_ms + per_token_ms_before·(g(N) − g₀) while g(N) ≤ compute_bound_tokens, then rises by
    per_token_ms_after per token past that knee: flat within a graph size, stepping up at each boundary,
    linear once compute-bound. Past the largest graph size the pass runs eagerly (+ eager_ms), with N
    rounded up to a multiple of eager_granularity. Every step adds per_request_ms·B (KV-cache reads);
    drafting adds draft_ms + draft_per_request_ms·B. The plain cost is the pass at N = B without drafting.

    Keys: layout ("ragged"), base_ms, graph_sizes ([1, 2, 4, …, 512]), per_token_ms_before
    (per_token_ms_after / 10), per_token_ms_after, compute_bound_tokens, per_request_ms (0), eager_ms
    (0), eager_granularity (16), draft_ms (0), draft_per_request_ms (0), max_batch (512). Keys starting
    with "comment" are ignored. Rows cover B = 1..max_batch and N up to B·(1 + max_drafts); the model
    extrapolates past them. A missing or bad key fails naming it.
    """
    def num(key: str, default: float | None = None, positive: bool = False) -> float:
        v = spec.get(key, default)
        if v is None:
            raise ValueError(f"gpu cost spec: field {key!r} is missing")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0 or (positive and v == 0):
            raise ValueError(f"gpu cost spec: field {key!r} must be a {'positive' if positive else 'non-negative'} "
                             f"number, got {v!r}")
        return float(v)

    known = {"layout", "base_ms", "graph_sizes", "per_token_ms_before", "per_token_ms_after", "compute_bound_tokens",
             "per_request_ms", "eager_ms", "eager_granularity", "draft_ms", "draft_per_request_ms", "max_batch"}
    unknown = [k for k in spec if k not in known and not str(k).startswith("comment")]
    if unknown:
        raise ValueError(f"gpu cost spec: unknown field(s) {unknown}; known: {sorted(known)}")
    base = num("base_ms", positive=True)
    after = num("per_token_ms_after")
    before = num("per_token_ms_before", after / 10)
    knee = num("compute_bound_tokens", positive=True)
    per_req, eager = num("per_request_ms", 0.0), num("eager_ms", 0.0)
    gran = int(num("eager_granularity", 16, positive=True))
    draft, draft_req = num("draft_ms", 0.0), num("draft_per_request_ms", 0.0)
    max_batch = int(num("max_batch", 512, positive=True))
    graphs = spec.get("graph_sizes", [2 ** i for i in range(10)])
    if (not isinstance(graphs, list) or not graphs
            or not all(isinstance(g, int) and not isinstance(g, bool) and g > 0 for g in graphs)):
        raise ValueError(f"gpu cost spec: field 'graph_sizes' must be a non-empty list of positive integers, got {graphs!r}")
    graphs = np.array(sorted(set(graphs)), dtype=np.int64)
    layout = spec.get("layout", "ragged")
    top = max_batch * (1 + max_drafts)

    def padded(n: np.ndarray) -> np.ndarray:
        i = np.minimum(np.searchsorted(graphs, n), len(graphs) - 1)
        eager_n = -(-n // gran) * gran
        return np.where(n <= graphs[-1], graphs[i], eager_n)

    def target_ms(n: np.ndarray) -> np.ndarray:
        p = padded(n).astype(np.float64)
        below = np.minimum(p, knee) - graphs[0]
        return base + before * np.maximum(below, 0) + after * np.maximum(p - knee, 0) + eager * (n > graphs[-1])

    # cell boundaries: every graph size, then eager multiples of the granularity
    cells = np.unique(np.concatenate([graphs, np.arange(-(-(graphs[-1] + 1) // gran) * gran, top + 2 * gran, gran)]))
    cell_ms = target_ms(cells)
    drafted, plain = {}, {}
    for b in range(1, max_batch + 1):
        lo = int(np.searchsorted(cells, b))  # every graph size from B on, eager cells up to B·(1 + max_drafts)
        hi = max(len(graphs), int(np.searchsorted(cells, b * (1 + max_drafts)))) + 2
        ns, ms = cells[lo:hi], cell_ms[lo:hi]
        extra = per_req * b
        drafted[b] = list(zip(ns.tolist(), ((ms + extra + draft + draft_req * b) / 1000).tolist()))
        plain[b] = float(target_ms(np.array([b]))[0] + extra) / 1000
    return CostModel(drafted, plain, layout)


def load_gpu_curve(path: str | Path, max_drafts: int = 8) -> CostModel:
    """`gpu_cost_model` of a JSON spec file; a missing or malformed file fails naming it."""
    p = Path(path)
    data = read_json(p, "gpu curve file")
    if not isinstance(data, Mapping):
        raise ValueError(f"gpu curve file {p}: top level must be a JSON object")  # noqa: TRY004
    try:
        return gpu_cost_model(data, max_drafts)
    except ValueError as err:
        raise ValueError(f"gpu curve file {p}: {err}") from None


# ------------------------------------------------------------------------------------------------------
# sweeps and plots


def _by_domain(traces: Sequence[Trace]) -> dict[str, list[Trace]]:
    out: dict[str, list[Trace]] = {}
    for t in traces:
        out.setdefault(t.domain or "all", []).append(t)
    return out


def threshold_sweep(traces: Trace | Sequence[Trace], cost: CostModel, survival_map: Any,
                    thresholds: Sequence[float], concurrency: int, steps: int | None = None,
                    seed: int = 0) -> list[dict[str, Any]]:
    """Per domain, "threshold:θ" for each θ, plus "dspark" and the full block as references (theta None).

    Rows: domain, scheduler, theta and `SimResult.to_dict()` (τ, verified drafts per step, tokens/s, …).
    """
    traces = [traces] if isinstance(traces, Trace) else list(traces)
    rows = []
    for domain, group in _by_domain(traces).items():
        pool = _Pool(group, survival_map)
        specs = [(f"threshold:{th:g}", float(th)) for th in thresholds]
        specs += [("dspark", None), (f"fixed:{pool.gamma}", None)]
        for spec, theta in specs:
            res = _simulate(pool, spec, cost, concurrency, steps, seed, None)
            rows.append({"domain": domain, "theta": theta, **res.to_dict()})
    return rows


def concurrency_sweep(traces: Trace | Sequence[Trace], schedulers: Sequence[str], cost: CostModel,
                      survival_map: Any = None, concurrencies: Sequence[int] = DEFAULT_CONCURRENCIES,
                      steps: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Every scheduler at every concurrency on the pooled traces: one row each (`SimResult.to_dict()`),
    with speedup over "none" at the same concurrency when "none" is among the schedulers."""
    pool = _Pool([traces] if isinstance(traces, Trace) else list(traces), survival_map)
    rows = []
    for c in concurrencies:
        block = [_simulate(pool, s, cost, c, steps, seed, None).to_dict() for s in schedulers]
        base = next((r["tokens_per_s"] for r in block if r["scheduler"] == "none"), None)
        for r in block:
            r["speedup"] = r["tokens_per_s"] / base if base else None
        rows += block
    return rows


def format_concurrency_table(rows: Sequence[Mapping[str, Any]], key: str = "tokens_per_s") -> str:
    """Text table: one line per concurrency, one column per scheduler, cells `key` (for tokens_per_s with the
    speedup over "none" in brackets)."""
    scheds = list(dict.fromkeys(r["scheduler"] for r in rows))
    concs = sorted({r["concurrency"] for r in rows})
    cell = {(r["scheduler"], r["concurrency"]): r for r in rows}
    width = max(14, *(len(s) + 2 for s in scheds))
    lines = [f"{'concurrency':>11}" + "".join(f"{s:>{width}}" for s in scheds)]
    for c in concs:
        parts = []
        for s in scheds:
            r = cell.get((s, c))
            if r is None:
                parts.append(f"{'-':>{width}}")
                continue
            sp = f" ({r['speedup']:.2f}x)" if key == "tokens_per_s" and r.get("speedup") else ""
            parts.append(f"{_fmt(r[key]) + sp:>{width}}")
        lines.append(f"{c:>11}" + "".join(parts))
    return "\n".join(lines)


def format_threshold_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Text table of a threshold sweep: per domain and scheduler, τ, verified/wasted drafts per step, tokens/s."""
    lines = [f"{'domain':<8}{'scheduler':<16}{'tau':>7}{'verified/step':>15}{'wasted/step':>13}{'tok/s':>12}{'drafted':>9}"]
    for r in rows:
        lines.append(f"{r['domain']:<8}{r['scheduler']:<16}{r['tau']:>7.2f}{r['verified_per_step']:>15.2f}"
                     f"{r['wasted_per_step']:>13.2f}{_fmt(r['tokens_per_s']):>12}{r['draft_share']:>9.2f}")
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.4g}" if abs(x) < 1000 else f"{x:.0f}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_threshold_sweep(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """PNG with τ, verified drafts per step and tokens/s against θ, one line per domain; dashed: dspark."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    for d, color in zip(domains, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4):
        sweep = sorted((r for r in rows if r["domain"] == d and r["theta"] is not None), key=lambda r: r["theta"])
        ref = next((r for r in rows if r["domain"] == d and r["scheduler"] == "dspark"), None)
        for ax, key in zip(axes, ("tau", "verified_per_step", "tokens_per_s")):
            ax.plot([r["theta"] for r in sweep], [r[key] for r in sweep], marker="o", color=color, label=d)
            if ref is not None:
                ax.axhline(ref[key], color=color, linestyle="--", alpha=0.7)
    for ax, label in zip(axes, ("τ (tokens per request-step)", "verified drafts per step", "tokens / s")):
        ax.set_xlabel("threshold θ")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, title="dashed: dspark", title_fontsize=8)
    return _save_figure(plt, fig, path, title)


def _save_figure(plt, fig, path: str | Path, title: str) -> Path:
    """Title, lay out, write the PNG (creating its folder) and close the figure."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = save_figure_atomic(fig, path)
    plt.close(fig)
    return out


def plot_concurrency_sweep(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """PNG with aggregate tokens/s, speedup over "none" and median per-user tokens/s against concurrency."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for s in dict.fromkeys(r["scheduler"] for r in rows):
        mine = sorted((r for r in rows if r["scheduler"] == s), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        style = {"linewidth": 2.5} if s.startswith("dspark") else {"linewidth": 1.2, "alpha": 0.8}
        axes[0].plot(xs, [r["tokens_per_s"] for r in mine], marker=".", label=s, **style)
        if all(r.get("speedup") for r in mine):
            axes[1].plot(xs, [r["speedup"] for r in mine], marker=".", label=s, **style)
        axes[2].plot(xs, [r["per_user_median"] if r["per_user_median"] is not None else math.nan for r in mine],
                     marker=".", label=s, **style)
    for ax, label in zip(axes, ("aggregate tokens / s", "speedup over none", "median per-user tokens / s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    return _save_figure(plt, fig, path, title)
