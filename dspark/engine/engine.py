"""The continuous-batching engine: one step admits, prefills a chunk, drafts, schedules, verifies and commits.

Requests arrive (`add`) and leave (finish, `cancel`) at any time. Each `step()`:

1. drop cancelled requests (their rows and memory go now);
2. admit waiting requests while running rows, the per-step token budget and the KV budget allow;
3. take the next chunk of the joining requests' prompts (kept in a cache of their own until they join;
   while others are running at most `prefill_chunk` slots, so a long prompt never stalls them;
   `dspark.engine.prefill`). With nothing running the chunk runs in a padded pass of its own, whose width
   feeds the most prompt tokens per cost; beside running requests it rides in the round's target pass
   (step 4: `CausalLM.forward_with` packs both batches' tokens into one model call where the target allows,
   `EngineConfig.fuse_prefill`), so the step pays one pass's fixed cost, not two. Requests whose prompt is
   in commit their first token, sampled from the prefill's last logits, and join the batch with it as their
   anchor: at once when the chunk ran alone (they decode in this step's round), after the round when it
   rode in it (they decode from the next step);
4. one decoding round for every running request: one batched drafting call → calibrated survival a[r, k]
   → the verification scheduler's ℓ_r → one target pass over the anchors and ℓ_r drafts (and the prefill
   chunk) → batched verification → per-request commit and rollback → stop conditions → stream the
   committed tokens.

The running rows' target cache may be split into padded groups by length (`dspark.row_groups`, opt-in with
`EngineConfig.row_groups`): a long prompt gets a group of its own rather than widening every short row's
attention; one model call still feeds every group and the prefill chunk.

Faults stay with the requests they belong to. A drafting call that raises is retried row by row
(`Drafter.propose_rows`, which leaves the drafter's state as it was): the rows that raise alone finish with
finish_reason "error" (`request_errors`), the others decode this round without drafts; an error no single
row reproduces, or one anywhere else in the step, propagates (the server's runner then fails the step's
requests). Rows whose drafts carry NaN / inf probabilities or confidences verify no drafts that round
(`nonfinite_drafts`). A drafting call slower than `EngineConfig.draft_timeout` pauses drafting for a back-off
of rounds, doubling while calls stay slow (`draft_timeouts`); paused rounds are plain decoding rounds, and the
drafter still observes them. All three are lossless for every other request.

The drafter sleeps through an adaptive scheduler's long back-offs (`EngineConfig.drafter_sleep`): a drafter that
reads target features keeps a context of them per request, built at join and extended every round, drafting or
not. While the scheduler expects no drafting for many steps (`Scheduler.dormant`) the engine drops that state,
captures no features and makes no drafter call; requests running or admitted then have no drafter context
("blind"). The drafter wakes ahead of the next probe: requests admitted after that are drafted for as usual,
and the blind ones get a context that starts where the drafter woke (`Drafter.join_late`; from their join for
those whose prompt was in by then) and draft again after LATE_WARMUP rounds of it. A drafter that cannot join
rows late (EAGLE-3) leaves them without drafts until they finish, drafting only for the others.

`dspark.decoding.decode` (and so `generate`, `bench`, `profile`, `calibrate`) runs a fixed set of requests
through this loop; the server calls the same `step` from its engine thread.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from itertools import groupby
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, NamedTuple

try:
    import resource
except ImportError:  # not on Windows
    resource = None

import torch

from dspark.attention import segment_cost
from dspark.drafters.base import DraftBlock, Drafter, NoDrafter, RoundOutcome, drafter_gamma
from dspark.engine.gc_clock import gc_clock
from dspark.engine.prefill import fused_prefill_width, prefill_width
from dspark.engine.rate_guard import RateGuard
from dspark.engine.request import Request, RequestOutput, RoundStats
from dspark.engine.survival import reads_q, survival_for
from dspark.engine.text import TextStream
from dspark.pass_fit import PassFit, less_chunk
from dspark.row_groups import RowGroups
from dspark.sampling import BatchSampling, SamplingParams, make_generator
from dspark.scheduling import CostModel, Scheduler, step_tokens
from dspark.target import CausalLM, ForwardOutput
from dspark.verify import verify

log = logging.getLogger("dspark.engine")
DRAFT_BACKOFF_MAX = 64  # rounds drafting stays paused at most after a slow drafting call
SORT_EVERY = 8  # steps between looks at whether sorting the running rows pays (`EngineConfig.sort_rows`)
SORT_GAIN = 0.2  # the share of attention's segment cost (`dspark.attention.segment_cost`) a sort must save
LATE_WARMUP = 8  # rounds a row whose drafter context started late (`Drafter.join_late`) goes undrafted


def thread_page_faults() -> int | None:
    """The calling thread's minor page faults so far (Linux `getrusage(RUSAGE_THREAD)`; None elsewhere)."""
    who = getattr(resource, "RUSAGE_THREAD", None) if resource is not None else None
    return None if who is None else int(resource.getrusage(who).ru_minflt)


class QueueFull(RuntimeError):
    """The waiting queue is at its limit: try again later."""


@dataclass
class StepInfo:
    """One decoding round as measured: what the cost model is fitted and corrected on, and the metrics read.

    seconds: the round (drafting, target pass, verification, commit), which the cost model predicts;
    draft_seconds / schedule_seconds / target_seconds: its drafting call, survival + scheduler, and its target
    pass; prefill_seconds: the step's prefill chunk; step_seconds: the whole engine step. tokens: the verify pass's
    query tokens in the cost model's layout. predicted_seconds: the cost model's figure for this round before it
    was measured (online correction included; None without a cost model); plain_predicted_seconds: its figure
    for a plain round of the same batch at the same moment (what a drafted round was weighed against).
    started: perf_counter() when the step began (the gap to the previous step's end is time the engine thread
    spent outside `step`). kv_slots: the target cache's slots a row attends over before the round's pass,
    averaged over rows (holes left by rolled-back drafts included; from each row's first slot on where attention
    runs in row segments, the cache's width otherwise: `CausalLM.attended_slots`);
    kv_live: the tokens the rows hold (their lengths summed); join_seconds: the part of prefill_seconds spent
    moving finished prefills into the batch (target cache and drafter state). prefill_slots: the prefill pass's
    prefilling rows × its width (prefill_tokens plus padding).
    asleep: the drafter slept through this round (`EngineConfig.drafter_sleep`); blind: rows without drafter
    context (admitted or running while it slept, until it wakes and joins them late), which verify no drafts.
    planned: the scheduler computed survivals and planned the round (an adaptive one skips planning where it
    does not pay, `plan_pays`, and then verifies every available draft). fused_prefill: the step's prefill chunk
    went through the round's target pass (its cost is in seconds and target_seconds; prefill_seconds is then the
    join alone). draft_width: the
    slots the drafting call drafted per row (None when the round did not draft), which the cost model prices.
    expected_gain / backoff_left / gate_bias: an adaptive scheduler's state after the round
    (`Scheduler.expected_gain`, `backoff_left`, `gate_bias`; None / 0 / None for the others). chunk_seconds:
    a fused round's estimated share of its prefill chunk, taken off before the cost model's online correction
    sees the round (`dspark.pass_fit`; None when not fused or not fitted yet). cpu_seconds: the engine
    thread's CPU time over the whole step (`time.thread_time`); with one torch thread on a CPU, step_seconds −
    cpu_seconds is time the thread waited (for the interpreter lock, or for a core), not computed.
    expected_accepted: a planned round's calibrated survivals summed over the drafts it verifies (the accepted
    drafts its plan expected; None when not planned or planned without survivals). sort_seconds: the step's
    look at the running rows' order and the reorder, if it made one (`EngineConfig.sort_rows`; outside the
    round, inside step_seconds). page_faults: the engine thread's minor page faults over the step (memory touched
    for the first time since the kernel mapped it; None where the platform does not count them per thread).
    gc_seconds / gc_full: seconds the process spent in Python's garbage collector during the step, in any thread
    (a collection holds the interpreter lock: `dspark.engine.gc_clock`), and how many of those collections were
    full (generation 2) ones.
    """

    batch: int
    tokens: int
    drafted: bool
    seconds: float
    lengths: list[int]
    expected_throughput: float | None = None
    capacity: int | None = None
    accepted: list[int] = field(default_factory=list)
    prefill_tokens: int = 0
    draft_seconds: float = 0.0
    schedule_seconds: float = 0.0
    target_seconds: float = 0.0
    prefill_seconds: float = 0.0
    step_seconds: float = 0.0
    predicted_seconds: float | None = None
    plain_predicted_seconds: float | None = None
    started: float = 0.0
    kv_slots: float = 0.0
    kv_live: int = 0
    join_seconds: float = 0.0
    prefill_slots: int = 0
    asleep: bool = False
    blind: int = 0
    planned: bool = False
    fused_prefill: bool = False
    draft_width: int | None = None
    sort_seconds: float = 0.0
    expected_gain: float | None = None
    backoff_left: int = 0
    gate_bias: float | None = None
    chunk_seconds: float | None = None
    cpu_seconds: float = 0.0
    page_faults: int | None = None
    gc_seconds: float = 0.0
    gc_full: int = 0
    expected_accepted: float | None = None


StepCallback = Callable[[StepInfo], None]


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request per step, in order of first appearance: a joining request commits its prefill's
    token and then its first round's in the same step, which leave the engine together."""
    merged: dict[int, RequestOutput] = {}
    for out in outputs:
        seq = out.request.seq
        if seq not in merged:
            merged[seq] = out
        else:
            prev = merged[seq]
            merged[seq] = RequestOutput(out.request, prev.token_ids + out.token_ids, prev.text + out.text,
                                        prev.finished or out.finished)
    return list(merged.values())


class _RoundInputs(NamedTuple):
    """The running rows of one decoding round and what drafting and verification read of them."""

    rows: list[Request]
    params: list[SamplingParams]
    sampling: BatchSampling
    gens: list[torch.Generator]
    seqs: list[list[int]]
    budget: list[int]  # drafts each row may verify (max_tokens left, its draft cap)


@dataclass
class EngineConfig:
    """Admission and loop settings.

    max_running: requests decoding (or prefilling) at once; max_waiting: queue length before `add` refuses.
    token_budget: query tokens (anchors + verified drafts) of one verify pass. kv_budget_tokens: slots the
    target's KV cache may allocate (rows × padded width, prefilling rows included; None: no limit). Rows are
    padded to the widest, so admission counts every row at the longest reservation (prompt + max_tokens + one
    block) among them, and the cache compacts before a pass would widen it past that.
    prefill_chunk: slots (prefilling rows × the pass's width) one prefill pass may span while other requests
    are decoding, the width maximising prompt tokens fed per cost; prompt tokens a chunk fused into the round's
    pass may feed (`dspark.engine.prefill`).
    online_cost: correct the cost model from measured rounds, and teach it each step's overhead outside its
    round (prefill chunk, bookkeeping, the wait until the next step) against its rows and committed tokens;
    the fixed part of that fit is added to every cost so that Θ prices whole steps. record_signals: keep each
    round's survival signals in its RoundStats. detokenize: keep each request's text (needs the target's tokenizer).
    draft_timeout: seconds a drafting call may take; a slower one pauses drafting for 1, 2, 4, … rounds (at
    most DRAFT_BACKOFF_MAX; back to 1 after a call within the limit). None: never paused.
    rate_guard: with an adaptive scheduler, turn drafting off for whole windows of steps while measured
    throughput (committed tokens per second of wall time, per load) says plain decoding is faster
    (`dspark.engine.rate_guard`). Off by default: since the cost model prices served steps itself (plain
    probes, per-kind offsets, the overhead's fixed part), the guard's plain windows cost more than they
    caught in the load sweep (docs/serving.md).
    drafter_sleep: with an adaptive scheduler and a drafter that reads target features, drop the drafter's
    per-request context while the scheduler is far into a back-off (`Scheduler.dormant`); see the module doc.
    fuse_prefill: feed a prefill chunk beside running requests in the round's own target pass where the
    target packs (`CausalLM.packs`), instead of in a pass of its own; a plain probe (a round an adaptive
    scheduler runs without drafting to measure what plain rounds cost, `Scheduler.plain_probes`) leaves its
    chunk to a pass of its own unless `fuse_plain_probes`, so that it measures a plain round as it is rather than
    less an estimated share of a chunk that can cost as much as the round itself. pass_fit: with the online correction,
    learn what target passes cost beyond the table (`dspark.pass_fit`): price each round at the cache's context,
    and let the correction see rounds that fed a prefill chunk, less the chunk's fitted share. Off, the
    correction sees unfused rounds only (under load, few) and every context costs as the profile's.
    paid_compaction: compact the target's cache once the attention its holes (slots past the longest row:
    rolled-back drafts, rows that left) cost since the last compaction reaches what a compaction is measured to
    cost (rent or buy; the fitted seconds per query token per slot, `dspark.pass_fit`), besides the cache's own
    rule (holes past max(64, longest / 2)). Off by default: it cuts the slots rows attend over, but served and
    paired runs left its effect on throughput unsettled (benchmarks/results/serving/paid_compaction/).
    sort_rows: every SORT_EVERY steps, order the running rows by the slot their text starts at where attention
    in row segments (`dspark.attention.segment_cost`: row × slot pairs read, plus kernel calls) would then cost
    at least SORT_GAIN less: the rows of like length sit together, and a short row's queries skip the slots
    before its text. The caches copy every row once per sort (a permutation, as `select` makes it). One padded
    cache only (`row_groups` = 1).
    row_groups: padded caches the running rows may be split over by length (`dspark.row_groups`: a long
    prompt in a group of its own instead of widening every row); 1 (the default) keeps every row in one cache.
    Opt-in: in paired blocks at 32 clients, temperature 1, two groups left `none` level and `dspark` within the
    noise, 0.96x (benchmarks/results/serving/row_groups/).
    """

    max_running: int = 64
    max_waiting: int = 1024
    token_budget: int | None = None
    kv_budget_tokens: int | None = None
    prefill_chunk: int = 256
    online_cost: bool = True
    record_signals: bool = False
    detokenize: bool = True
    draft_timeout: float | None = None
    rate_guard: bool = False
    drafter_sleep: bool = True
    fuse_prefill: bool = True
    fuse_plain_probes: bool = False
    pass_fit: bool = True
    paid_compaction: bool = False
    row_groups: int = 1
    sort_rows: bool = True

    def __post_init__(self) -> None:
        for name in ("max_running", "max_waiting", "prefill_chunk", "row_groups"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("token_budget", "kv_budget_tokens"):
            value = getattr(self, name)
            if value is not None and int(value) < 1:
                raise ValueError(f"{name} must be a positive number of tokens (or None), got {value}")
        if self.draft_timeout is not None and not float(self.draft_timeout) > 0:
            raise ValueError(f"draft_timeout must be a positive number of seconds (or None), got {self.draft_timeout}")


class Engine:
    """Continuous batching with speculative decoding over one target and one drafter."""

    def __init__(self, target: CausalLM, drafter: Drafter, scheduler: str | Scheduler = "fixed",
                 cost_model: CostModel | None = None, config: EngineConfig | None = None,
                 online_calibration=None, eos_token_ids: frozenset[int] | None = None,
                 on_step: StepCallback | None = None) -> None:
        self.target, self.drafter = target, drafter
        self.config = config or EngineConfig()
        self.gamma = drafter_gamma(drafter)
        self.scheduler = scheduler if isinstance(scheduler, Scheduler) else Scheduler(scheduler, self.gamma)
        if self.scheduler.never_drafts:  # no drafter upkeep (target features, context caches) for drafts never made
            self.drafter = drafter = NoDrafter()
        if self.scheduler.needs_cost and cost_model is None:
            raise ValueError(f"scheduler {self.scheduler.spec!r} needs a cost model: run `dspark profile` or "
                             f"pass cost_model")
        self.cost_model = cost_model
        if cost_model is not None:
            cost_model.set_context(None, None)  # whatever context another engine priced it at
        self.layout = cost_model.layout if cost_model is not None else "padded"
        self.online_calibration = online_calibration
        self.eos = target.eos_token_ids if eos_token_ids is None else frozenset(eos_token_ids)
        self.on_step = on_step
        self.context_limit = getattr(target.model.config, "max_position_embeddings", None)
        self.want_features = bool(drafter.feature_layers)
        if self.want_features and list(target.feature_layers) != list(drafter.feature_layers):
            target.set_feature_layers(drafter.feature_layers)
        self.rows = RowGroups(target, self.config.row_groups)  # the running rows' caches (target is the first)
        self.rows.max_width = None  # set per admitted batch under a KV budget (another engine may have left one)
        drafter.reset()
        calibration = getattr(drafter, "calibration", None)  # greedy peaks cost a pass over the vocabulary:
        drafter.report_peaks = self.config.record_signals or bool(  # only when recorded or read
            getattr(calibration, "greedy_reads_q", False))
        self.prefill_lm = target.empty_like()  # joining requests' rows, until their prompt is in
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []  # row r of the target cache and the drafter is running[r]
        self._lock = threading.Lock()  # guards waiting and the cancel set (the server adds from other threads)
        self._cancel: set[str] = set()
        self._features: dict[int, list[torch.Tensor]] = {}
        self._streams: dict[int, TextStream] = {}
        self._gens: dict[int, torch.Generator] = {}
        self._seqs: dict[int, list[int]] = {}
        self.reserved = 0  # KV tokens reserved by admitted requests
        self.steps = 0
        self._fresh: set[int] = set()  # requests whose first token was committed in this step
        self._join_seconds = 0.0
        self._prefill_slots = 0
        # (start, round seconds, rows, committed tokens, prefill seconds) of the last step with a round
        self._last_round: tuple[float, float, int, int, float] | None = None
        self.request_errors = 0  # requests finished with "error" by a fault in their own drafting
        self.nonfinite_drafts = 0  # row rounds whose drafts were dropped for NaN / inf
        self.draft_timeouts = 0  # drafting calls slower than config.draft_timeout
        self._draft_backoff = 0  # rounds of the last pause (doubles while calls stay slow)
        self._draft_pause = 0  # rounds left without drafting
        self.rate_guard = RateGuard() if self.scheduler.adaptive and self.config.rate_guard else None
        self._committed = 0  # tokens committed so far (the rate guard's counts)
        self._last_step: tuple[float, float, int, int, float] | None = None  # start, seconds, committed, rows, greedy
        self._can_sleep = bool(self.config.drafter_sleep and self.scheduler.adaptive and self.want_features)
        self._asleep = False  # the drafter holds no rows and no target features are captured
        self._blind: set[int] = set()  # requests without a drafter context: they verify no drafts
        self._gc = gc_clock()  # seconds the process spends in garbage collection (StepInfo.gc_seconds)
        self._warming: dict[int, int] = {}  # requests whose context started late (`join_late`): rounds left undrafted
        self.drafter_sleeps = 0  # times the drafter was put to sleep
        self._pass_fit = PassFit()  # target passes beyond the table: the context's slots, a fused chunk's share
        # fitted only where read: the cost model's online correction with the pass fit, or paid compaction
        self._fits_passes = bool(self.config.paid_compaction or (
            cost_model is not None and self.config.online_cost and self.config.pass_fit))
        self._hole_rent = 0.0  # seconds of attention the cache's holes cost since its last compaction
        self._compactions_seen = self.rows.compactions
        self._since_sort = 0  # steps since the rows were last considered for sorting
        self.row_sorts = 0  # times the running rows were reordered (`EngineConfig.sort_rows`)

    # ------------------------------------------------------------------ requests in and out
    def check(self, request: Request) -> None:
        """Raise ValueError naming the field when the request can never be served."""
        prompt = request.prompt_ids
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {request.max_tokens}")
        vocab = self.target.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if self.context_limit is not None and len(prompt) + request.max_tokens > self.context_limit:
            raise ValueError(f"prompt has {len(prompt)} tokens; with max_tokens={request.max_tokens} that exceeds "
                             f"the target's context of {self.context_limit} tokens")
        if request.max_draft is not None and request.max_draft < 0:
            raise ValueError(f"max_draft must be >= 0, got {request.max_draft}")
        if request.stop and (self.target.tokenizer is None or not self.config.detokenize):
            raise ValueError("stop strings need the target's tokenizer (detokenize=True)")
        budget = self.config.kv_budget_tokens
        if budget is not None and self._reservation(request) > budget:
            raise ValueError(f"prompt + max_tokens ({len(prompt)} + {request.max_tokens}) exceed the engine's KV "
                             f"budget of {budget} tokens")

    def add(self, request: Request) -> Request:
        """Queue a request (checked first); raise QueueFull when the waiting queue is at its limit."""
        self.check(request)
        with self._lock:
            if len(self.waiting) >= self.config.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (limit {self.config.max_waiting})")
            request.state = "waiting"
            self.waiting.append(request)
        return request

    def cancel(self, request_id: str) -> None:
        """Cancel a request; its row and memory are freed at the start of the next step."""
        with self._lock:
            self._cancel.add(request_id)

    @property
    def pass_fit(self) -> PassFit:
        """The online fit of this engine's target passes (`dspark.pass_fit`): the context's and a fused chunk's
        slopes it prices steps with (fitted only with a cost model, online correction and `pass_fit` on)."""
        return self._pass_fit

    @property
    def cost_stalls(self) -> int:
        """Step times the online cost model took as stalls (`CostModel.stalls`; 0 without a cost model)."""
        return self.cost_model.stalls if self.cost_model is not None else 0

    @property
    def has_work(self) -> bool:
        """True while any request waits, prefills or runs."""
        return bool(self.waiting or self.prefilling or self.running)

    def run(self, requests: Iterable[Request]) -> list[Request]:
        """Add the requests and step until every one has finished; return them in order."""
        requests = [self.add(r) for r in requests]
        while self.has_work:
            self.step()
        return requests

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return what each request committed in it (finished ones included)."""
        start, cpu_start, faults_start = time.perf_counter(), time.thread_time(), thread_page_faults()
        gc_seconds_start, gc_full_start = self._gc.seconds, self._gc.full
        self._observe_overhead(start)
        self._observe_rate(start)
        committed = self._committed
        outputs: list[RequestOutput] = []
        self._fresh.clear()
        self._drop_cancelled(outputs)
        self._rejudge_load()
        self._update_sleep()
        sort_start = time.perf_counter()
        self._sort_rows()
        sort_seconds = time.perf_counter() - sort_start
        self._admit()
        prefill_start = time.perf_counter()
        self._join_seconds, self._prefill_slots = 0.0, 0
        # Beside running rows, the chunk rides in the round's target pass where the target packs (one pass's
        # fixed cost instead of two): its rows join after the round and decode from the next step.
        fused = bool(self.running) and self.config.fuse_prefill and self.target.packs
        chunks = self._prefill_chunks(fused)
        prefill_tokens = 0
        if chunks is not None and not fused:
            prefill_tokens = self._prefill(chunks, outputs)
        prefill_seconds = time.perf_counter() - prefill_start
        side = chunks if fused else None
        self._side_fed = False
        info = self._decode_round(outputs, side) if self.running else None
        if side is not None and not self._side_fed:  # the round ended before its pass: the chunk goes alone
            prefill_start = time.perf_counter()
            prefill_tokens = self._prefill(side, outputs)
            prefill_seconds = time.perf_counter() - prefill_start
        elif side is not None:  # fed in the round's pass: what is left outside it is the join
            prefill_tokens, prefill_seconds = sum(len(c) for c in side), self._join_seconds
            self._prefill_slots = prefill_tokens
        if info is not None:
            info.fused_prefill = self._side_fed
            info.prefill_tokens, info.prefill_seconds = prefill_tokens, prefill_seconds
            info.join_seconds, info.prefill_slots = self._join_seconds, self._prefill_slots
            info.step_seconds, info.started = time.perf_counter() - start, start
            info.sort_seconds = sort_seconds
            info.cpu_seconds = time.thread_time() - cpu_start
            faults = thread_page_faults()
            info.page_faults = None if faults is None or faults_start is None else faults - faults_start
            info.gc_seconds, info.gc_full = self._gc.seconds - gc_seconds_start, self._gc.full - gc_full_start
            if self.on_step is not None:
                self.on_step(info)
        self._last_round = None if info is None else \
            (start, info.seconds, info.batch, self._committed - committed, prefill_seconds)
        self._last_step = None
        if info is not None:
            greedy = sum(req.sampling.greedy for req in self.running) / len(self.running) if self.running else 0.0
            self._last_step = (start, time.perf_counter() - start, self._committed - committed, info.batch, greedy)
        self.steps += 1
        return merge_outputs(outputs)

    @staticmethod
    def _idle_between(period: float, step_seconds: float) -> bool:
        """Whether the time from one step's start to the next was idleness rather than that step's work."""
        return period >= 10 * step_seconds + 1.0

    def _observe_overhead(self, now: float) -> None:
        """Teach the cost model what the last step cost outside its round (its prefill, bookkeeping and the
        wait until this step), when it ran a round and the engine did not go idle in between."""
        last, self._last_round = self._last_round, None
        if last is None or self.cost_model is None or not self.config.online_cost or not self.running:
            return
        started, round_seconds, rows, tokens, prefill_seconds = last
        period = now - started
        if not self._idle_between(period, round_seconds):
            self.cost_model.observe_overhead(max(0.0, period - round_seconds), rows, tokens, prefill_seconds)

    def _observe_rate(self, now: float) -> None:
        """Give the rate guard the last step: its period up to this step, its committed tokens and rows; a step
        after the engine went idle (or ran no round) ends the guard's window without counting the wait."""
        guard, last, self._last_step = self.rate_guard, self._last_step, None
        if guard is None:
            return
        if last is None:
            guard.discard()
            return
        started, seconds, tokens, rows, greedy = last
        period = now - started
        if self._idle_between(period, seconds):
            guard.discard()
            return
        guard.record(period, tokens, rows, unsure=self.scheduler.unsure, greedy=greedy)

    def _reservation(self, request: Request) -> int:
        return len(request.prompt_ids) + request.max_tokens + self.gamma + 1

    def _widest(self, extra: Request | None = None) -> int:
        """The longest reservation among admitted requests (and `extra`): the width no row ever needs to pass."""
        rows = [*self.running, *self.prefilling, *([extra] if extra is not None else [])]
        return max((self._reservation(r) for r in rows), default=0)

    def _limit_width(self) -> None:
        """Under a KV budget, cap both caches' width at the longest admitted reservation."""
        if self.config.kv_budget_tokens is not None:
            width = self._widest() or None
            self.rows.max_width = width
            self.prefill_lm.max_width = width

    def _drop_cancelled(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            if not self._cancel:
                return
            gone, self._cancel = self._cancel, set()
            for req in [r for r in self.waiting if r.request_id in gone]:
                self.waiting.remove(req)
                self._finish(req, "cancelled", outputs)
        hit = [r for r, req in enumerate(self.prefilling) if req.request_id in gone]
        if hit:
            self.prefill_lm.take(hit)
            for r in hit:
                self._finish(self.prefilling[r], "cancelled", outputs)
            self.prefilling = [req for req in self.prefilling if not req.finished]
        self._leave([r for r, req in enumerate(self.running) if req.request_id in gone], "cancelled", outputs)

    def _admit(self) -> None:
        admitted = 0
        with self._lock:
            while self.waiting and len(self.running) + len(self.prefilling) < self.config.max_running:
                req = self.waiting[0]
                need = self._reservation(req)
                budget = self.config.kv_budget_tokens
                rows = len(self.running) + len(self.prefilling) + 1
                if budget is not None and rows * self._widest(req) > budget:
                    break
                self.waiting.popleft()
                self.reserved += need
                req.state = "prefilling"
                self._gens[req.seq] = make_generator(req.sampling.seed, self.target.device)
                self._seqs[req.seq] = list(req.prompt_ids)
                self._features[req.seq] = []
                if self._asleep:
                    self._blind.add(req.seq)
                if self.config.detokenize and self.target.tokenizer is not None:
                    self._streams[req.seq] = TextStream(self.target.tokenizer, req.stop)
                self.prefilling.append(req)
                admitted += 1
        if admitted:
            self.prefill_lm.add_rows(admitted)
            self._limit_width()

    def _prefill_chunks(self, fused: bool) -> list[list[int]] | None:
        """The next chunk of each joining prompt (None: nothing to feed). While others are running a chunk
        spans at most `prefill_chunk` slots (a separate pass, `prefill_width`) or prompt tokens (a pass fused
        with the round's, `fused_prefill_width`: it pays no fixed cost of its own and computes no padding);
        under a KV budget a pass may not widen the prefill cache past its limit, even after compaction (which
        leaves the longest row's slots): lagging rows catch up in several chunks."""
        if not self.prefilling:
            return None
        budget = None if not self.running else self.config.prefill_chunk
        limit = self.prefill_lm.max_width
        cap = None if limit is None else limit - max(req.prefilled for req in self.prefilling)
        todo = [len(req.prompt_ids) - req.prefilled for req in self.prefilling]
        width = fused_prefill_width(todo, budget, cap) if fused else prefill_width(todo, budget, cap)
        chunks = [req.prompt_ids[req.prefilled : req.prefilled + width] for req in self.prefilling]
        return chunks if any(chunks) else None

    def _prefill(self, chunks: list[list[int]], outputs: list[RequestOutput]) -> int:
        """Prefill one chunk of the joining prompts in their own pass."""
        self._prefill_slots = len(chunks) * max(len(c) for c in chunks)
        out = self.prefill_lm.forward(chunks, features=self.want_features, last_logits_only=True)
        return self._prefilled(chunks, out, outputs)

    def _prefilled(self, chunks: list[list[int]], out: ForwardOutput, outputs: list[RequestOutput]) -> int:
        """Take in a prefill pass's outputs (last logits [R, 1, V], features). A prompt whose last token is in
        gives the request its first token, sampled from the prefill's last logits as a verify pass without
        drafts samples (the request's own sampling and generator), committed and streamed at once; that token
        is the first round's anchor, so every round drafts from an answer token, as the drafters were trained
        to. Returns the prompt tokens fed."""
        for r, (req, chunk) in enumerate(zip(self.prefilling, chunks)):
            if self.want_features and chunk and req.seq not in self._blind:
                self._features[req.seq].append(out.features[r, : len(chunk)])
            req.prefilled += len(chunk)
        done = [r for r, req in enumerate(self.prefilling) if chunks[r] and req.prefilled == len(req.prompt_ids)]
        if done:
            join_start = time.perf_counter()
            self._join(done, out.logits, outputs)
            self._join_seconds = time.perf_counter() - join_start
        return sum(len(c) for c in chunks)

    def _join(self, done: list[int], logits: torch.Tensor, outputs: list[RequestOutput]) -> None:
        """Move prefilled rows into the batch with their first token (logits [R, 1, V]: each prefilling row's
        last prompt token)."""
        joining = [self.prefilling[r] for r in done]
        pick = torch.tensor(done, device=logits.device)
        first_logits = logits[pick]  # [J, 1, V]
        params = [req.sampling for req in joining]
        nothing = torch.zeros(len(joining), 0, dtype=torch.long, device=logits.device)
        first = verify(first_logits, nothing, torch.zeros(len(joining), dtype=torch.long, device=logits.device), None,
                       BatchSampling.from_params(params, logits.device), [self._gens[req.seq] for req in joining])
        self.rows.extend(self.prefill_lm.take(done), [self._reservation(req) for req in joining])
        now = time.perf_counter()
        for req, tokens in zip(joining, first.tokens):
            req.rounds.append(RoundStats(0, 0, 0, None))  # the prefill pass committed one token
            self._commit(req, tokens, now, outputs)
        if not self._asleep:  # in batch order: rows with their prompt's features, then rows admitted while asleep
            for late, group in groupby(joining, key=lambda req: req.seq in self._blind):
                group = list(group)
                if not late:
                    self.drafter.join([self._seqs[req.seq] for req in group], self._join_features(group))
                else:
                    self._join_late(group)
        done_set = set(done)
        self.prefilling = [req for r, req in enumerate(self.prefilling) if r not in done_set]
        for req in joining:
            req.state = "running"
            self._features.pop(req.seq, None)
        start = len(self.running)
        self.running.extend(joining)
        self._leave([start + j for j, req in enumerate(joining) if req.finished], None, outputs)

    def _join_late(self, rows: list[Request]) -> None:
        """Give blind rows a drafter context that starts now (`Drafter.join_late`), where the drafter can; they
        draft once it holds LATE_WARMUP rounds of them."""
        if rows and self.drafter.join_late([self._seqs[req.seq] for req in rows]):
            for req in rows:
                self._blind.discard(req.seq)
                self._warming[req.seq] = LATE_WARMUP

    def _sighted(self, rows: list[Request]) -> list[int] | None:
        """Indices of the rows the drafter holds (None: all of them, the usual case)."""
        if not self._blind:
            return None
        return [r for r, req in enumerate(rows) if req.seq not in self._blind]

    def _join_features(self, joining: list[Request]) -> torch.Tensor | None:
        if not self.want_features:
            return None
        parts = [torch.cat(self._features[req.seq]) if self._features[req.seq] else None for req in joining]
        width = max(len(req.prompt_ids) for req in joining)
        dim = next((p.shape[-1] for p in parts if p is not None), None)
        if dim is None:  # only one-token prompts: no features at all
            dim = self.drafter_feature_dim()
        out = torch.zeros(len(joining), width, dim, device=self.target.device)
        for r, p in enumerate(parts):
            if p is not None:
                out[r, : p.shape[0]] = p
        return out

    def drafter_feature_dim(self) -> int:
        """Width of the concatenated target features the drafter reads."""
        return len(self.drafter.feature_layers) * int(self.target.model.config.hidden_size)

    def _round_inputs(self) -> _RoundInputs:
        rows = self.running
        params = [req.sampling for req in rows]
        budget = []
        for req in rows:
            left = req.max_tokens - len(req.output_ids) - 1
            if req.seq in self._blind or req.seq in self._warming:
                left = 0
            budget.append(left if req.draft_limit is None else min(left, req.draft_limit))
        return _RoundInputs(rows, params, BatchSampling.from_params(params, self.target.device),
                            [self._gens[req.seq] for req in rows], [self._seqs[req.seq] for req in rows], budget)

    def _wants_drafts(self, budget: list[int]) -> bool:
        """Whether this round calls the drafter (not while a slow drafting call's pause lasts)."""
        if self.gamma == 0 or max(budget) <= 0:
            if self._blind or self._warming:  # rows that could draft but lack drafter context: a back-off counts down
                self.scheduler.idle_step(len(budget))
            return False
        if self._draft_pause > 0:
            self._draft_pause -= 1
            return False
        if self.rate_guard is not None and not self.rate_guard.drafting:
            return False
        return self.scheduler.wants_drafts(len(budget))

    def _propose(self, batch: _RoundInputs, outputs: list[RequestOutput]) -> DraftBlock | None:
        """The round's drafting call, timed against draft_timeout. None when it raised and the rows whose
        drafting raises alone have failed (re-raised when no row does)."""
        call = time.perf_counter()
        sighted = self._sighted(batch.rows)
        self.drafter.draft_limit = self.scheduler.draft_limit  # set per call: engines may share a drafter
        try:
            if sighted is None:
                block = self.drafter.propose(batch.seqs, batch.sampling, batch.gens)
            else:  # blind rows have no drafter row: draft for the others
                sampling = BatchSampling.from_params([batch.params[r] for r in sighted], self.target.device)
                block = self.drafter.propose([batch.seqs[r] for r in sighted], sampling,
                                             [batch.gens[r] for r in sighted]).scatter(sighted, len(batch.rows))
        except Exception as err:
            if not self._fail_drafting_rows(err, batch, outputs):
                raise
            return None
        seconds, limit = time.perf_counter() - call, self.config.draft_timeout
        if limit is not None and seconds > limit:
            self.draft_timeouts += 1
            self._draft_backoff = min(DRAFT_BACKOFF_MAX, max(1, 2 * self._draft_backoff))
            self._draft_pause = self._draft_backoff
            log.warning("drafting took %.3f s (draft_timeout %.3f s): drafting paused for %d rounds", seconds, limit,
                        self._draft_pause)
        elif limit is not None:
            self._draft_backoff = 0
        return block

    def _fail_drafting_rows(self, err: Exception, batch: _RoundInputs, outputs: list[RequestOutput]) -> bool:
        """Find the rows whose drafting raises on its own (`propose_rows`, one row at a time) and finish them
        with "error"; False when the drafter cannot draft for a subset or no single row raises."""
        if type(self.drafter).propose_rows is Drafter.propose_rows:
            return False
        failed: dict[int, Exception] = {}
        sighted = self._sighted(batch.rows)
        for d, r in enumerate(range(len(batch.rows)) if sighted is None else sighted):
            one = BatchSampling.from_params([batch.params[r]], self.target.device)
            try:
                self.drafter.propose_rows([d], [batch.seqs[r]], one, [batch.gens[r]])
            except Exception as row_err:  # noqa: BLE001 - this row's fault: it fails alone
                failed[r] = row_err
        if not failed:
            return False
        for r, row_err in failed.items():
            req = batch.rows[r]
            req.error = f"internal error while drafting: {type(row_err).__name__}: {row_err}"
            log.error("request %s failed: %s", req.request_id, req.error, exc_info=row_err)
        self.request_errors += len(failed)
        self._leave(sorted(failed), "error", outputs)
        return True

    def _drop_nonfinite(self, block: DraftBlock) -> DraftBlock:
        """The block with no drafts for rows whose probabilities or confidences are NaN / inf where they count."""
        checks = [t for t in (block.probs, block.confidences) if t is not None]
        if not checks:
            return block
        width = block.tokens.shape[1]
        used = torch.arange(width, device=block.lengths.device).view(1, -1) < block.lengths.view(-1, 1)
        ok = torch.ones_like(block.lengths, dtype=torch.bool)
        for t in checks:
            t = t[:, :width]
            # probabilities [R, γ, V]: their sum over the vocabulary is finite exactly when every entry is (they
            # lie in [0, 1]), and costs a twentieth of checking each of R·γ·V entries (1.7 against 0.05 ms at
            # 16 rows, 7 drafts, 8,192 tokens on one CPU thread)
            finite = torch.isfinite(t.flatten(2).sum(-1) if t.dim() > 2 else t)
            ok &= (finite | ~used[:, : finite.shape[1]]).all(-1)
        if bool(ok.all()):
            return block
        self.nonfinite_drafts += int((~ok).sum())
        lengths = torch.where(ok, block.lengths, torch.zeros_like(block.lengths))
        return replace(block, lengths=lengths)

    def _decode_round(self, outputs: list[RequestOutput], side: list[list[int]] | None = None) -> StepInfo | None:
        """One decoding round of the running rows; `side`: a prefill chunk of the joining rows fed in the same
        target pass (`CausalLM.forward_with`), its rows joining once the round has committed."""
        start = time.perf_counter()
        device, sched = self.target.device, self.scheduler
        self._compact_if_paid()
        if self.cost_model is not None and self.config.online_cost and self.config.pass_fit:
            # price this round at the context its pass will attend over
            self.cost_model.set_context(self._pass_fit.slot_seconds, self.rows.slots)
        batch = self._round_inputs()
        probes = sched.plain_probes
        drafted, faulted = self._wants_drafts(batch.budget), False
        if side is not None and sched.plain_probes > probes and not self.config.fuse_plain_probes:
            side = None  # a plain probe measures a plain round alone: the chunk goes in a pass of its own after it
        block = self._propose(batch, outputs) if drafted else None
        if drafted and block is None:  # the rows whose drafting raised have left: the rest decode without drafts
            drafted, faulted = False, True
            if not self.running:
                return None
            batch = self._round_inputs()
        rows, params, sampling, gens, seqs, budget = batch
        drafted_width = None if block is None else int(block.tokens.shape[1])  # what the drafting call cost
        if block is None:
            block = DraftBlock.empty(len(rows), device)
        block = block.truncate(budget)
        if drafted:
            block = self._drop_nonfinite(block)
        draft_seconds = time.perf_counter() - start
        available = block.lengths.tolist()
        theta = capacity = signals = expected_accepted = None
        planned = drafted and sched.kind not in ("fixed", "none")
        skipped = planned and not sched.plan_pays(available, self.cost_model, self.config.token_budget)
        if skipped:  # planning would cost more than it is expected to gain: verify the whole block
            planned = False
            block = block.truncate(sched.full_plan(available, self.cost_model, self.config.token_budget).lengths)
        if drafted and (self.config.record_signals or (self.online_calibration is not None and not skipped)):
            from dspark.calibration.signals import block_signals

            q = self.config.record_signals or reads_q(getattr(self.drafter, "calibration", None),
                                                      self.online_calibration)
            signals = block_signals(block, sampling.greedy, q=q)
        if planned:
            survival = None
            if sched.needs_survival:
                survival = survival_for(self.drafter, block, sampling, [p.temperature for p in params], signals,
                                        self.online_calibration, [req.workload for req in rows])
            plan = sched.plan(survival, available, self.cost_model, self.config.token_budget,
                              [req.seq for req in rows])
            block = block.truncate(plan.lengths)
            theta, capacity = plan.expected_throughput, plan.capacity
            if survival is not None:  # what the plan expects to be accepted (for step logs; the verdict is below)
                a = torch.as_tensor(survival)
                reach = torch.arange(a.shape[1], device=a.device).view(1, -1) < \
                    torch.tensor(plan.lengths, device=a.device).view(-1, 1)
                expected_accepted = float(a[reach].sum())
        elif drafted and sched.kind in ("fixed", "none"):
            block = block.truncate(sched.plan(None, available, self.cost_model, self.config.token_budget).lengths)
        lens = block.lengths.tolist()
        schedule_seconds = time.perf_counter() - start - draft_seconds
        drafts = block.tokens.tolist()
        inputs = [[s[-1]] + drafts[r][: lens[r]] for r, s in enumerate(seqs)]
        base_len = self.rows.lengths
        kv_slots, kv_live = self.rows.slots, int(base_len.sum())
        holes = self.rows.holes if self.config.paid_compaction else 0.0  # read only for the holes' rent
        target_start = time.perf_counter()
        if side is not None:
            out, side_out = self.rows.forward_with(self.prefill_lm, inputs, side, features=self.want_features)
        else:
            out = self.rows.forward(inputs, features=self.want_features)
        target_seconds = time.perf_counter() - target_start
        width = max(lens) + 1 if lens else 1
        draft_tokens = block.tokens[:, : width - 1]
        if draft_tokens.shape[1] < width - 1:
            draft_tokens = torch.nn.functional.pad(draft_tokens, (0, width - 1 - draft_tokens.shape[1]))
        probs = block.probs[:, : width - 1] if block.probs is not None else None
        res = verify(out.logits[:, :width], draft_tokens, block.lengths, probs, sampling, gens)
        for r, req in enumerate(rows):  # a stop token among the accepted drafts ends the round (and the request)
            stops = self._stop_ids(req)
            cut = next((j for j, t in enumerate(res.tokens[r]) if t in stops), None)
            if cut is not None and cut < res.accepted[r]:
                res.tokens[r], res.accepted[r] = res.tokens[r][: cut + 1], cut + 1
        # Keep the anchor and the accepted drafts in the target cache; the new token is the next anchor.
        self.rows.truncate(base_len + 1 + torch.tensor(res.accepted, device=device))
        if not self._asleep:
            sighted = self._sighted(rows)
            if sighted is None:
                self.drafter.observe(RoundOutcome(committed=res.tokens, accepted=res.accepted, features=out.features))
            elif sighted:
                feats = None if out.features is None else out.features[torch.tensor(sighted, device=device)]
                self.drafter.observe(RoundOutcome([res.tokens[r] for r in sighted], [res.accepted[r] for r in sighted],
                                                  feats))
        observe_start = time.perf_counter()
        if self.online_calibration is not None and signals is not None and not skipped:
            # the verified prefix labels positions 1..ℓ (admission read signals); one call per step, one refit
            kept = [r for r in range(len(rows)) if lens[r] > 0]
            if kept:
                self.online_calibration.observe_step(
                    signals[kept] if len(kept) < len(rows) else signals, [lens[r] for r in kept],
                    [res.accepted[r] for r in kept], [params[r].greedy for r in kept],
                    [rows[r].workload for r in kept], [rows[r].seq for r in kept],
                    [params[r].temperature for r in kept])
        if planned:  # what planning cost this step, for `plan_pays`
            sched.observe_own_work(schedule_seconds + time.perf_counter() - observe_start)
        seconds = time.perf_counter() - start
        tokens = step_tokens(lens, self.layout)
        prompt_tokens = sum(len(c) for c in side) if side is not None else 0
        if self._fits_passes:
            self._pass_fit.observe(target_seconds, len(rows), tokens, kv_slots, prompt_tokens, side is not None)
        per_slot = self._pass_fit.slot_seconds if self.config.paid_compaction else None
        if per_slot is not None:  # what the holes cost this pass's queries
            self._hole_rent += per_slot * tokens * holes
        predicted = plain_predicted = chunk = None
        if self.cost_model is not None:
            fixed = self.cost_model.overhead.fixed(len(rows))  # the round's own figures (overhead is outside them)
            plain_predicted = self.cost_model.plain_cost(len(rows)) - fixed
            predicted = self.cost_model.cost(len(rows), tokens, drafted_width) - fixed if drafted else plain_predicted
            if self.config.online_cost and not faulted:
                measured = seconds
                if side is not None and not self.config.pass_fit:
                    measured = None
                elif side is not None:  # a fused pass fed the chunk too: its share comes off once it is fitted
                    chunk = self._pass_fit.chunk_seconds(prompt_tokens)
                    measured = None if chunk is None else less_chunk(seconds, chunk)
                if measured is not None:
                    self.cost_model.observe(len(rows), tokens, measured, drafted, drafted_width, slots=kv_slots)
        if self._warming and not self._asleep:  # the drafter observed one more round of each late row
            for req in rows:
                left = self._warming.get(req.seq)
                if left is not None:
                    if left <= 1:
                        del self._warming[req.seq]
                    else:
                        self._warming[req.seq] = left - 1
        now = time.perf_counter()
        for r, req in enumerate(rows):
            sig = signals[r, : available[r]].tolist() if self.config.record_signals and signals is not None else None
            req.rounds.append(RoundStats(lens[r], res.accepted[r], available[r], sig))
            self._commit(req, res.tokens[r], now, outputs)
        self._leave([r for r, req in enumerate(rows) if req.finished], None, outputs)
        info = StepInfo(len(rows), tokens, drafted, seconds, lens, theta, capacity, list(res.accepted),
                        draft_seconds=draft_seconds, schedule_seconds=schedule_seconds,
                        target_seconds=target_seconds, predicted_seconds=predicted,
                        plain_predicted_seconds=plain_predicted, kv_slots=kv_slots,
                        kv_live=kv_live, asleep=self._asleep,
                        blind=sum(req.seq in self._blind for req in rows) if self._blind else 0, planned=planned,
                        draft_width=drafted_width if drafted else None,
                        expected_gain=sched.expected_gain, backoff_left=sched.backoff_left,
                        gate_bias=sched.gate_bias(len(rows)), chunk_seconds=chunk,
                        expected_accepted=expected_accepted)
        if side is not None:  # the prefilled rows join after the round (`rows` is the running list itself)
            self._prefilled(side, side_out, outputs)
            self._side_fed = True
        return info

    def _compact_if_paid(self) -> None:
        """Compact the target's cache once its holes have cost, since its last compaction, what a compaction is
        measured to cost (`EngineConfig.paid_compaction`)."""
        target = self.rows
        if target.compactions != self._compactions_seen:  # it compacted meanwhile (its own rule, a KV limit)
            self._hole_rent, self._compactions_seen = 0.0, target.compactions
        if not self.config.paid_compaction or target.holes <= 0:
            return
        price = target.compact_price()
        if price is not None and self._hole_rent >= price:
            target.compact()
            self._hole_rent, self._compactions_seen = 0.0, target.compactions

    def _stop_ids(self, req: Request) -> frozenset[int]:
        return (req.stop_token_ids or frozenset()) | (frozenset() if req.ignore_eos else self.eos)

    def _commit(self, req: Request, tokens: list[int], now: float, outputs: list[RequestOutput]) -> None:
        """Append a round's tokens to a request, apply its stop conditions and emit what it committed."""
        new = tokens[: req.max_tokens - len(req.output_ids)]
        reason = None
        stops = self._stop_ids(req)
        for j, t in enumerate(new):
            if t in stops:
                new, reason = new[: j + 1], "stop"
                break
        req.output_ids.extend(new)
        self._seqs[req.seq].extend(new)
        self._committed += len(new)
        if new and (req.first_token_time is None or req.seq in self._fresh):
            # the prefill's token leaves the engine with the step's round: it is delivered at the step's last commit
            req.first_token_time = now
            self._fresh.add(req.seq)
        text = ""
        stream = self._streams.get(req.seq)
        if stream is not None:
            text, hit = stream.update(req.output_ids)
            if hit:  # the stop string's tokens end the output; text stops before it
                drop = len(req.output_ids) - stream.stop_tokens
                if drop > 0:
                    del req.output_ids[-drop:]
                    new = new[: max(0, len(new) - drop)]
                reason = "stop"
        if reason is None and len(req.output_ids) >= req.max_tokens:
            reason = "length"
        if reason is not None:
            req.finish_reason = reason
            if stream is not None and stream.stop_tokens is None:
                text += stream.flush()
            req.text = stream.text if stream is not None else ""
        elif stream is not None:
            req.text = stream.text[: stream.released]
        outputs.append(RequestOutput(req, new, text, reason is not None))

    def _leave(self, rows: list[int], reason: str | None, outputs: list[RequestOutput]) -> None:
        """Remove rows from the batch (target cache and drafter state) in the same step."""
        if not rows:
            return
        gone = set(rows)
        # rows from the end fill the leavers' places: the caches copy only the moved rows, not every row after
        # the first leaver (row order carries no meaning: every row is its own request)
        left = len(self.running) - len(gone)
        keep = list(range(left))
        movers = [r for r in range(left, len(self.running)) if r not in gone]
        for hole, mover in zip((r for r in range(left) if r in gone), movers):
            keep[hole] = mover
        leaving = [self.running[r] for r in rows]
        self._keep_rows(keep)
        for req in leaving:
            if reason is not None:
                self._finish(req, reason, outputs)
            else:
                self._release(req)

    def _sort_rows(self) -> None:
        """Order the running rows by the slot their text starts at, where attention's row segments then cost
        SORT_GAIN less than in the order they are in (`EngineConfig.sort_rows`)."""
        if not self.config.sort_rows or len(self.running) < 2 or len(self.rows.groups) != 1:
            return
        self._since_sort += 1
        if self._since_sort < SORT_EVERY:
            return
        self._since_sort = 0
        target = self.rows.groups[0]
        first = target.first_slots().tolist()
        slots = int(target.valid.shape[1])
        order = sorted(range(len(first)), key=first.__getitem__)
        if segment_cost([first[r] for r in order], slots) > (1 - SORT_GAIN) * segment_cost(first, slots):
            return
        self._keep_rows(order)
        self.row_sorts += 1

    def _keep_rows(self, keep: list[int]) -> None:
        """Keep the running rows `keep`, in that order: target cache, drafter state, requests."""
        self.rows.select(keep)
        if not self._asleep:
            sighted = self._sighted(self.running)
            if sighted is None:
                self.drafter.select(keep)
            else:  # the drafter's rows are the sighted rows, in order
                slot = {r: d for d, r in enumerate(sighted)}
                self.drafter.select([slot[r] for r in keep if r in slot])
        self.running = [self.running[r] for r in keep]

    def _finish(self, req: Request, reason: str, outputs: list[RequestOutput]) -> None:
        req.finish_reason = reason
        outputs.append(RequestOutput(req, [], "", True))
        self._release(req)

    def _release(self, req: Request) -> None:
        if req.state in ("prefilling", "running"):
            self.reserved -= self._reservation(req)
        req.state = "finished"
        if self.config.kv_budget_tokens is not None:  # the rows left may need less width
            self.rows.max_width = self.prefill_lm.max_width = max(
                (self._reservation(r) for r in (*self.running, *self.prefilling) if r is not req), default=0) or None
        req.finish_time = time.perf_counter()
        for store in (self._features, self._streams, self._gens, self._seqs):
            store.pop(req.seq, None)
        self._blind.discard(req.seq)
        self._warming.pop(req.seq, None)

    def _rejudge_load(self) -> None:
        """Before admitting: end an adaptive scheduler's back-off when requests arrive at an idle engine (the load it
        was decided at is gone), or, while the drafter sleeps, when the batch this step's admissions make is over
        2x from the back-off's, so that the rows joining now are captured whole rather than joined late."""
        idle = not (self.running or self.prefilling)
        if not self.scheduler.adaptive or not (idle or self._asleep):
            return
        coming = min(self.config.max_running, len(self.running) + len(self.prefilling) + len(self.waiting))
        if coming:
            self.scheduler.rejudge(coming, fresh=idle)

    def _update_sleep(self) -> None:
        """Put the drafter to sleep when the scheduler turns dormant, wake it when it no longer is."""
        if not self._can_sleep:
            return
        if self.scheduler.dormant == self._asleep:
            return
        if not self._asleep:
            self.drafter.reset()
            self._asleep, self.want_features = True, False
            self._blind.update(req.seq for req in (*self.running, *self.prefilling))
            self._warming.clear()
            for parts in self._features.values():
                parts.clear()
            self.drafter_sleeps += 1
            log.info("drafter asleep: the scheduler expects no drafting for many steps")
            return
        self._asleep, self.want_features = False, True
        # the drafter holds no rows: every running row gets a context from now on (where the drafter can), and
        # joining rows whose prompt is not fed yet are captured whole
        self._join_late([req for req in self.running if req.seq in self._blind])  # all of them: none joined asleep
        for req in self.prefilling:
            if req.prefilled == 0:
                self._blind.discard(req.seq)
        log.info("drafter awake: %d running requests draft from a context that starts now, %d stay without drafts",
                 len(self.running) - sum(req.seq in self._blind for req in self.running),
                 sum(req.seq in self._blind for req in self.running))
