"""Prometheus metrics of the server, in their own registry, named like vLLM's (prefix `dspark:`).

Updated from the engine thread: `observe_step` is the engine's on_step callback, `observe_outputs` the
runner's. Queue gauges and the calibration ECE are read when /metrics is scraped, off the hot path.

- inter_token_latency_seconds: for each step that commits n tokens to a request after its first, the time
  since its previous commit divided by n, observed once per token.
- verified_tokens_per_step: draft tokens the target verified in one step (all rows).
- prompt_tokens_total counts a request's prompt when it commits its first token.
- spec_decode_num_drafts_total counts rows that verified at least one draft in a step; decode_rounds_total
  counts every row of every decoding step and every request's prefill (the target pass that committed its
  first token), so τ = generation_tokens_total / decode_rounds_total, as a response's speculation.rounds.
- engine_request_errors_total, engine_nonfinite_drafts_total, engine_draft_timeouts_total: the engine's fault
  counters (requests failed alone by their drafting, row rounds whose NaN / inf drafts were dropped, drafting
  calls over draft_timeout), and engine_drafter_sleeps_total (times the drafter slept through a back-off),
  read from the engine at scrape time.
- kv_cache_tokens / kv_cache_bytes: the target KV cache as allocated now (rows × slot width, and the bytes of
  its key / value tensors), of the running batch and of the rows still prefilling (what
  EngineConfig.kv_budget_tokens bounds); kv_reserved_tokens: the sum of the admitted requests' reservations.
  All three are 0 when idle.
"""
from __future__ import annotations

import logging
import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from dspark.engine import Engine, RequestOutput, StepInfo

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
log = logging.getLogger("dspark.serving")
ENGINE_COUNTERS = (  # (metric, help, Engine attribute)
    ("dspark:engine_request_errors", "Requests finished with an error in their own drafting.", "request_errors"),
    ("dspark:engine_nonfinite_drafts", "Row rounds whose drafts were dropped for NaN/inf probabilities or "
     "confidences.", "nonfinite_drafts"),
    ("dspark:engine_draft_timeouts", "Drafting calls slower than draft_timeout (drafting paused after each).",
     "draft_timeouts"),
    ("dspark:engine_drafter_sleeps", "Times the drafter was put to sleep through a long back-off of the adaptive "
     "scheduler (its per-request context dropped).", "drafter_sleeps"),
    ("dspark:engine_cost_stalls", "Step times the online cost model took as stalls (over 2x its estimate and not "
     "confirmed by the next step of that batch size).", "cost_stalls"),
)


class _EngineCounters:
    """A collector of the engine's fault counters, read when /metrics is scraped."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        """One counter family per ENGINE_COUNTERS entry."""
        for name, doc, attr in ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(self.engine, attr, 0))


def kv_cache_size(engine: Engine) -> tuple[int, int]:
    """(slots, bytes) the target KV cache holds now: rows × slot width and its key / value storage, summed
    over the running batch and the prefilling rows (read from another thread: a snapshot, never exact)."""
    slots, seen, size = 0, set(), 0
    rows = getattr(engine, "rows", None)
    for lm in (*(list(rows.groups) if rows is not None else [engine.target]), getattr(engine, "prefill_lm", None)):
        valid = getattr(lm, "valid", None)
        if valid is not None and valid.dim() == 2:
            slots += int(valid.shape[0]) * int(valid.shape[1])
        cache = getattr(lm, "cache", None)
        for layer in getattr(cache, "layers", None) or ():
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if t is None or not hasattr(t, "untyped_storage"):
                    continue
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    size += storage.nbytes()
    return slots, size


class ServerMetrics:
    """The server's counters, gauges and histograms; `render()` gives the Prometheus text."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge("dspark:num_requests_running", "Requests prefilling or decoding.", registry=r)
        self.waiting = Gauge("dspark:num_requests_waiting", "Requests in the waiting queue.", registry=r)
        self.prompt_tokens = Counter("dspark:prompt_tokens", "Prompt tokens of requests that started.", registry=r)
        self.generation_tokens = Counter("dspark:generation_tokens", "Generated tokens.", registry=r)
        self.success = Counter("dspark:request_success", "Finished requests by finish reason.",
                               ["finished_reason"], registry=r)
        self.ttft = Histogram("dspark:time_to_first_token_seconds", "Arrival to first committed token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dspark:inter_token_latency_seconds", "Time between commits per committed token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("dspark:e2e_request_latency_seconds", "Arrival to finish.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("dspark:step_time_seconds", "Engine step (prefill, drafting, verification).",
                                   buckets=STEP_BUCKETS, registry=r)
        self.rounds = Counter("dspark:decode_rounds", "Request rounds (rows of every decoding step, drafted or not, "
                              "and prefills that committed a first token).", registry=r)
        self.num_drafts = Counter("dspark:spec_decode_num_drafts", "Rows that verified at least one draft.",
                                  registry=r)
        self.draft_tokens = Counter("dspark:spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.accepted_tokens = Counter("dspark:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                       registry=r)
        self.accepted_per_pos = Counter("dspark:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0-based).",
                                        ["position"], registry=r)
        self.verified = Histogram("dspark:verified_tokens_per_step", "Draft tokens verified in one step.",
                                  buckets=TOKEN_BUCKETS, registry=r)
        self.kv_tokens = Gauge("dspark:kv_cache_tokens", "Target KV cache slots allocated (rows x slot width).",
                               registry=r)
        self.kv_bytes = Gauge("dspark:kv_cache_bytes", "Bytes of the target KV cache's key and value tensors.",
                              registry=r)
        self.kv_reserved = Gauge("dspark:kv_reserved_tokens", "KV tokens reserved by admitted requests.",
                                 registry=r)
        self.capacity = Gauge("dspark:scheduler_capacity", "The verification scheduler's last capacity.",
                              registry=r)
        self.rate_guard = Gauge("dspark:rate_guard_drafting",
                                "1 while the engine may draft, 0 while its rate guard has drafting off (measured "
                                "plain decoding faster at this load).", registry=r)
        self.ece = Gauge("dspark:calibration_ece", "Online calibration ECE of the served survival, per workload.",
                         ["workload"], registry=r)
        self._positions: list = []  # accepted_per_pos children, by position
        self._last_commit: dict[int, float] = {}  # request seq → time of its last commit
        self._calibrator = None
        self._engine_counters: _EngineCounters | None = None

    def watch(self, engine: Engine) -> None:
        """Read the engine's queue lengths, KV cache size (and its online calibrator's ECE) at scrape time."""
        self.running.set_function(lambda: len(engine.running) + len(engine.prefilling))
        self.waiting.set_function(lambda: len(engine.waiting))
        self.kv_tokens.set_function(lambda: kv_cache_size(engine)[0])
        self.kv_bytes.set_function(lambda: kv_cache_size(engine)[1])
        self.kv_reserved.set_function(lambda: engine.reserved)
        self.rate_guard.set_function(lambda: float(engine.rate_guard is None or engine.rate_guard.drafting))
        self._calibrator = engine.online_calibration
        if self._engine_counters is None:
            self._engine_counters = _EngineCounters(engine)
            self.registry.register(self._engine_counters)
        self._engine_counters.engine = engine

    # ------------------------------------------------------------------ engine thread
    def observe_step(self, info: StepInfo) -> None:
        """Record one engine step (the engine's on_step callback; a failure here is logged, never raised)."""
        try:
            self._observe_step(info)
        except Exception:  # noqa: BLE001 - raising inside engine.step would fail the step's requests
            log.exception("step metrics failed")

    def _observe_step(self, info: StepInfo) -> None:
        self.step_time.observe(info.step_seconds or info.seconds)
        self.rounds.inc(info.batch)
        drafted = sum(info.lengths)
        self.verified.observe(drafted)
        if info.capacity is not None:
            self.capacity.set(info.capacity)
        if not drafted:
            return
        self.num_drafts.inc(sum(1 for n in info.lengths if n > 0))
        self.draft_tokens.inc(drafted)
        accepted = sum(info.accepted)
        if accepted:
            self.accepted_tokens.inc(accepted)
        for a in info.accepted:
            for k in range(a):
                if k == len(self._positions):
                    self._positions.append(self.accepted_per_pos.labels(position=str(k)))
                self._positions[k].inc()

    def observe_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """Record what one step committed and which requests finished (the runner's on_outputs callback)."""
        for out in outputs:
            req, n = out.request, len(out.token_ids)
            if n:
                self.generation_tokens.inc(n)
                last = self._last_commit.get(req.seq)
                if last is None:
                    self.prompt_tokens.inc(len(req.prompt_ids))
                    self.rounds.inc()  # the prefill pass that committed its first token
                    if req.first_token_time is not None:
                        self.ttft.observe(req.first_token_time - req.arrival_time)
                else:
                    gap = (now - last) / n
                    for _ in range(n):
                        self.itl.observe(gap)
                self._last_commit[req.seq] = now
            if out.finished:
                self._last_commit.pop(req.seq, None)
                self.success.labels(finished_reason=req.finish_reason or "unknown").inc()
                self.e2e.observe((req.finish_time or now) - req.arrival_time)

    # ------------------------------------------------------------------ scrape
    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (refreshing the calibration ECE first)."""
        if self._calibrator is not None:
            for workload, state in self._calibrator.state_dict()["workloads"].items():
                ece = state.get("ece")
                if ece is not None and not (isinstance(ece, float) and math.isnan(ece)):
                    self.ece.labels(workload=workload).set(ece)
        return generate_latest(self.registry)
