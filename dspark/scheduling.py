"""Verification scheduling: how many of its drafts each request verifies in a step.

The policies are pure functions of the survival estimates a[r, k] = P(drafts 1..k of request r all
accepted), each request's limit (drafts available, speculation off, tokens left) and a cost model of the
whole step; `Scheduler` wraps them with the little state some need (stale survivals for `dspark-async`,
the back-off that skips drafting when it does not pay).

Losslessness needs non-anticipation: whether draft k is verified may depend on drafts 1..k−1 and on q_k,
never on x_k. Survivals are non-increasing along a block and the global admission order breaks ties by
position, so a[r, k+1..] never precede (r, k): a cut of that order that reads only what precedes the cut
(Algorithm 1's early stop, a budget, a count fixed before the step) keeps every request's admitted set a
prefix decided before its next token is looked at. A global argmax over the whole order does not
(paper, Appendix A) and is not offered.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import numpy as np
import torch

from dspark.step_overhead import StepOverhead

POLICIES = ("none", "fixed:K", "threshold:θ", "batch-table[:B=K,...]", "dspark", "dspark-async")
LAYOUTS = ("padded", "ragged")
#: how a cost model reads its table between profiled points: "step" rounds B and N up to the next profiled value
#: (a GPU engine padding to captured sizes), "linear" interpolates (a CPU, where a step's cost grows with every
#: row and token)
LOOKUPS = ("step", "linear")


def lookup_for(device: str) -> str:
    """The table lookup that fits steps on `device`: "linear" on a CPU, "step" elsewhere (`CostModel.lookup`)."""
    return "linear" if str(device).split(":")[0] == "cpu" else "step"


def step_tokens(lengths: np.ndarray, layout: str) -> int:
    """Query tokens of the target pass for per-request draft counts: B + Σℓ (ragged) or B·(1 + max ℓ) (padded)."""
    lengths = np.asarray(lengths)
    if lengths.size == 0:
        return 0
    if layout == "ragged":
        return int(lengths.size + lengths.sum())
    return int(lengths.size * (1 + lengths.max()))


@dataclass
class CostModel:
    """Seconds of one whole decoding step, from a profiled table.

    drafted[B] lists (N, seconds) for steps that drafted for B requests and sent N query tokens to the
    target (drafting, the target pass, verification and commit all timed together); plain[B] is the
    seconds of a step without drafting (N = B). `layout` says how the target counts tokens: "padded" (every
    row padded to the longest: N = B·(1 + max ℓ), dspark's batched KV cache) or "ragged" (N = B + Σℓ,
    flattened kernels as in vLLM).

    `lookup` "step" keeps the curve's steps: B and N round up to the next profiled value (as a CUDA-graph
    engine pads to the next captured size), never interpolating across a cliff. "linear" (what a CPU's steps
    follow, `lookup_for`) interpolates: within a batch row linearly in N between profiled cells, and between
    the two profiled rows around B linearly in B at the same tokens per row (B = 50 drafting 4 a row is priced
    between the 32- and 64-row steps of width 4, not as a 64-row step of 250 tokens, which "step" prices like
    50 rows drafting 3). Past the largest profiled value the last two points extrapolate linearly. Within a
    batch row the costs are made non-decreasing in N (a cell dearer than a larger one is noise: one bump would
    stop Algorithm 1's admission before it). `observe` corrects the table online from measured steps.
    """

    drafted: dict[int, list[tuple[int, float]]]
    plain: dict[int, float]
    layout: str = "padded"
    #: weight of a new measurement in the online correction (exponential forgetting of log-ratios)
    alpha: float = 0.25
    #: measurements after which a step kind or cell counts as stale and follows the level above it
    stale_after: int = 32
    #: measurements over which a batch row's count of measurements halves (the level's reference row)
    REFERENCE_HALF_LIFE: ClassVar[int] = 64
    #: a measurement over 2x (or under 1/2x) its cell's estimate moves the model as if it were 2x (1/2x), unless
    #: the row's previous measurement deviated as far the same way: one stall of one pass (a 248 ms target pass
    #: among 20 ms ones at 16 requests, in process beside three other engines) otherwise raised the drafted
    #: cells 1.6x and backed drafting off for a whole block; a lasting change shows in two steps in a row
    STALL_LOG: ClassVar[float] = math.log(2.0)
    #: seconds one more drafted slot adds to a drafted step, per profiled batch size (the drafting call's slope
    #: in its width, `dspark.profiling.profile_steps`); with `width`, a step drafting fewer slots than the
    #: profile did costs that much less (`width_saving`). Empty: the drafted width costs nothing
    draft_slot: dict[int, float] = field(default_factory=dict)
    #: the drafted width at which the drafted cells were measured (None: unknown; the width costs nothing)
    width: int | None = None
    #: online correction, in log(measured / table): a machine-wide level; per step kind (drafted / plain)
    #: and per cell its mean, the level and the measurement count when it was last measured, and how many
    #: measurements it has had (a cell: since it was new or last went stale)
    _level: float = field(default=0.0, repr=False)
    _count: int = field(default=0, repr=False)
    _kinds: dict[str, tuple[float, float, int, int]] = field(default_factory=dict, repr=False)
    _cells: dict[tuple, tuple[float, float, int, int]] = field(default_factory=dict, repr=False)
    #: the level's reference: the batch row (drafted or plain) measured most lately, the level and that row's
    #: log correction when it became the reference, and per row its measurements with forgetting (weight,
    #: measurement count when last updated)
    _reference: tuple | None = field(default=None, repr=False)
    _reference_base: tuple[float, float] = field(default=(0.0, 0.0), repr=False)
    _row_weights: dict[tuple, tuple[float, int]] = field(default_factory=dict, repr=False)
    #: per batch row (drafted or plain), the sign of its last measurement's deviation beyond `STALL_LOG` (0: none)
    _outliers: dict[tuple, int] = field(default_factory=dict, repr=False)
    #: measurements taken as stalls so far (moved the model as a 2x one would), out of `_count`
    stalls: int = field(default=0, repr=False, compare=False)
    #: seconds every step pays outside its round (prefill chunk, bookkeeping, the wait before the next step),
    #: learned online (`observe_overhead`) as a + c·B + b·T; its fixed part a + c·B is added to drafted and plain
    #: costs alike (the per-token part b·T cannot change a decision, see `dspark.step_overhead`)
    overhead: StepOverhead = field(default_factory=StepOverhead, repr=False)
    #: each drafted row's corrected cells (`_row_scales`), valid for the measurement count `_scales_at`
    _scales: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, init=False, repr=False,
                                                               compare=False)
    _scales_at: int = field(default=-1, init=False, repr=False, compare=False)
    #: cache slots per row the table was measured at (a profile's context length); None: steps are priced
    #: whatever the context (`set_context` has no effect)
    reference_slots: int | None = None
    #: the context coming steps are priced at (`set_context`): seconds per query token per slot, slots per row
    _context: tuple[float, int] | None = field(default=None, init=False, repr=False, compare=False)
    #: how the table is read between profiled points (see the class docstring; not saved with the table: it
    #: belongs to the device, `lookup_for`)
    lookup: str = "step"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"cost model layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.lookup not in LOOKUPS:
            raise ValueError(f"cost model lookup must be one of {LOOKUPS}, got {self.lookup!r}")
        if not self.drafted or not self.plain:
            raise ValueError("a cost model needs at least one drafted and one plain entry")
        self.drafted = {int(b): sorted((int(n), float(s)) for n, s in cells) for b, cells in self.drafted.items()}
        self.plain = {int(b): float(s) for b, s in self.plain.items()}
        self.draft_slot = {int(b): float(s) for b, s in self.draft_slot.items()}
        for b, s in self.draft_slot.items():
            if not (math.isfinite(s) and s >= 0):
                raise ValueError(f"cost model draft_slot B={b} has seconds={s}; expected a non-negative number")
        if self.width is not None and (int(self.width) != self.width or self.width < 1):
            raise ValueError(f"cost model width must be a positive integer, got {self.width!r}")
        self._slot_batches = np.array(sorted(self.draft_slot))
        for b, cells in self.drafted.items():
            if not cells:
                raise ValueError(f"cost model row B={b} has no cells")
            for n, s in cells:
                if not (math.isfinite(s) and s > 0):
                    raise ValueError(f"cost model cell B={b} N={n} has seconds={s}; expected a positive number")
        for b, s in self.plain.items():
            if not (math.isfinite(s) and s > 0):
                raise ValueError(f"cost model plain B={b} has seconds={s}; expected a positive number")
        self._batches = np.array(sorted(self.drafted))
        self._plain_batches = np.array(sorted(self.plain))
        # lookup rows: a step never costs more than one of the same batch that verifies more tokens, so a
        # profiled cell dearer than a larger one (measurement noise) is priced at the larger one's cost
        self._rows = {b: (np.array([n for n, _ in c]), _envelope(np.array([s for _, s in c])))
                      for b, c in self.drafted.items()}

    # -- lookup ---------------------------------------------------------------------------------------
    def _row_for(self, batch: int) -> tuple[int, float]:
        """(profiled B at or above `batch`, factor for batches beyond the largest profiled one)."""
        _, hi, _, factor = self._around(self._batches, batch)
        return hi, factor

    @staticmethod
    def _around(points: np.ndarray, batch: int) -> tuple[int, int, float, float]:
        """Linear lookup over the sorted profiled batch sizes `points`: (the one below or at `batch`, the one at or
        above it, the upper one's weight, factor for batches beyond the largest). Below the smallest: that one
        alone."""
        i = int(np.searchsorted(points, batch))
        if i >= len(points):
            top = int(points[-1])
            return top, top, 1.0, batch / top
        hi = int(points[i])
        if hi == batch or i == 0:
            return hi, hi, 1.0, 1.0
        lo = int(points[i - 1])
        return lo, hi, (batch - lo) / (hi - lo), 1.0

    def _rows_around(self, batch: int) -> tuple[int, int, float, float]:
        """`_around` over the drafted rows."""
        return self._around(self._batches, batch)

    def _cells_of(self, batch: int, tokens: np.ndarray) -> tuple[int, np.ndarray]:
        """(the drafted row whose cells a step of `batch` requests and `tokens` query tokens is corrected in, the
        cell index of each entry: len(cells) past the table). Step lookup: the cell it rounds up to; linear: the
        nearest cell of the upper row at the same tokens per row."""
        n = np.asarray(tokens, dtype=np.float64)
        if self.lookup == "step":
            b, factor = self._row_for(batch)
            return b, np.minimum(np.searchsorted(self._rows[b][0], n / factor), len(self._rows[b][0]))
        hi = self._rows_around(batch)[1]
        ns = self._rows[hi][0]
        at = n * (hi / batch)  # the same tokens per row (past the largest row too: hi / batch = 1 / factor)
        idx = np.searchsorted((ns[1:] + ns[:-1]) / 2.0, at) if len(ns) > 1 else np.zeros(at.shape, dtype=np.int64)
        return hi, np.where(at > ns[-1], len(ns), idx)

    @staticmethod
    def _curve(ns: np.ndarray, secs: np.ndarray, n: np.ndarray, linear: bool) -> np.ndarray:
        """A row's seconds at query-token counts n: its cells' (the next cell's, or linearly between cells),
        the last two cells' slope past the last."""
        out = np.interp(n, ns, secs) if linear else secs[np.minimum(np.searchsorted(ns, n), len(ns) - 1)]
        past = n > ns[-1]
        if past.any():
            if len(ns) >= 2 and ns[-1] > ns[-2]:
                slope = max(0.0, (secs[-1] - secs[-2]) / (ns[-1] - ns[-2]))
            else:
                slope = secs[-1] / max(1, ns[-1])
            out[past] = secs[-1] + slope * (n[past] - ns[-1])
        return out

    def _lookup(self, batch: int, tokens: np.ndarray, rows: dict[int, np.ndarray]) -> np.ndarray:
        """Seconds of drafted steps at `batch` for `tokens`, reading each profiled row b's cells from rows[b]
        (the table's or corrected ones), per `lookup`."""
        n = np.asarray(tokens, dtype=np.float64)
        if self.lookup == "step":
            b, factor = self._row_for(batch)
            return self._curve(self._rows[b][0], rows[b], n / factor, False) * factor
        lo, hi, t, factor = self._rows_around(batch)
        if factor != 1.0:
            return self._curve(self._rows[hi][0], rows[hi], n / factor, True) * factor
        out = self._curve(self._rows[hi][0], rows[hi], n * (hi / batch), True)
        if t < 1.0:  # between two profiled rows: both at the same tokens per row
            out = t * out + (1.0 - t) * self._curve(self._rows[lo][0], rows[lo], n * (lo / batch), True)
        return out

    def _base_many(self, batch: int, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Table seconds and cell index (`_cells_of`) for query-token counts `tokens` at `batch` (no online
        correction)."""
        base = self._lookup(batch, tokens, {b: secs for b, (_, secs) in self._rows.items()})
        return base, self._cells_of(batch, tokens)[1]

    def cost_many(self, batch: int, tokens: np.ndarray, width: int | None = None) -> np.ndarray:
        """Seconds of drafted steps with `batch` requests for each entry of `tokens` (vectorised), drafting
        `width` slots (None: the profiled width)."""
        base, idx = self._base_many(batch, tokens)
        if not self._cells:
            out = base * self._scale(None, "d")
        elif self.lookup == "step":
            b, factor = self._row_for(batch)
            ns, _ = self._rows[b]
            scale, corrected = self._row_scales(b)
            out = base * scale[idx]
            inside = idx < len(ns)
            out[inside] = corrected[idx[inside]] * factor  # corrected cells stay monotone too
        else:  # each profiled row around B read from its corrected cells (monotone), past them scaled as the step
            lo, hi, _, _ = self._rows_around(batch)
            out = self._lookup(batch, tokens, {b: self._row_scales(b)[1] for b in {lo, hi}})
            past = idx == len(self._rows[hi][0])
            if past.any():
                out[past] = base[past] * self._row_scales(hi)[0][-1]
        saving = self.width_saving(batch, width)
        if saving:  # never below half the profiled width's cost: a slope extrapolated too far is not trusted
            out = np.maximum(out - saving, 0.5 * out)
        context = self.context_seconds(np.asarray(tokens, dtype=np.float64))
        if context is not None:  # a shorter context than the profile's saves at most half
            out = np.maximum(out + context, 0.5 * out)
        return out + self.overhead.fixed(batch)

    def width_saving(self, batch: int, width: int | None) -> float:
        """Seconds a drafted step of `batch` requests saves by drafting `width` slots instead of the profiled
        width (negative when wider): `draft_slot` at the profiled batch size at or above `batch` (scaled up
        past the largest), times the slots saved, times the online correction of drafted steps. 0 without
        per-slot costs, a profiled width or a `width`."""
        if width is None or self.width is None or not self.draft_slot or width == self.width:
            return 0.0
        lo, hi, t, factor = self._around(self._slot_batches, batch)
        if self.lookup == "step":
            lo, t = hi, 1.0
        slot = (t * self.draft_slot[hi] + (1.0 - t) * self.draft_slot[lo]) * factor
        return slot * (self.width - int(width)) * self._scale(None, "d")

    def _row_scales(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(correction factor of each cell of drafted row `b` and past it [len + 1], the row's corrected
        seconds made monotone [len]); cached until the next measurement changes the corrections."""
        if self._scales_at != self._count:  # a measurement since: every row's corrections may have moved
            self._scales, self._scales_at = {}, self._count
        hit = self._scales.get(b)
        if hit is None:
            ns, secs = self._rows[b]
            scale = np.array([self._scale(("d", b, i), "d") for i in range(len(ns) + 1)])
            hit = self._scales[b] = (scale, _envelope(secs * scale[:-1]))
        return hit

    def cell_end_many(self, batch: int, tokens: np.ndarray) -> np.ndarray:
        """The largest query-token count that costs the same as each entry of `tokens` (its profiled cell's
        size; the count itself past the table, where every token costs, and with linear lookup)."""
        if self.lookup == "linear":
            return np.asarray(tokens, dtype=np.int64).copy()
        b, factor = self._row_for(batch)
        ns, _ = self._rows[b]
        n = np.asarray(tokens, dtype=np.float64)
        idx = np.searchsorted(ns, n / factor)
        out = n.copy()
        inside = idx < len(ns)
        out[inside] = np.floor(ns[idx[inside]] * factor)
        return np.maximum(out, n).astype(np.int64)

    def cost(self, batch: int, tokens: int, width: int | None = None) -> float:
        """Seconds of a drafted step with `batch` requests and `tokens` query tokens, drafting `width` slots
        (None: the profiled width)."""
        return float(self.cost_many(batch, np.array([tokens]), width)[0])

    def _plain_key(self, batch: int) -> tuple[int, float]:
        """`_row_for` over the plain steps' batch sizes."""
        _, hi, _, factor = self._around(self._plain_batches, batch)
        return hi, factor

    def _plain_around(self, batch: int) -> list[tuple[int, float]]:
        """The profiled plain rows a plain step of `batch` requests is read from, with their weights (scaled past
        the largest): the next one up with step lookup, the two around it with linear."""
        lo, hi, t, factor = self._around(self._plain_batches, batch)
        if self.lookup == "step" or lo == hi:
            return [(hi, factor)]
        return [(hi, t), (lo, 1.0 - t)]

    def plain_cost(self, batch: int) -> float:
        """Seconds of a step that does not draft (target-only decoding of `batch` requests)."""
        out = sum(self.plain[b] * w * self._scale(("p", b), "p") for b, w in self._plain_around(batch))
        context = self.context_seconds(batch)
        if context is not None:
            out = max(out + float(context), 0.5 * out)
        return out + self.overhead.fixed(batch)

    def set_context(self, slot_seconds: float | None, slots: int | None) -> None:
        """Price coming steps (and read measured ones) at `slots` cache slots per row, one query token's
        attention costing `slot_seconds` per slot (`dspark.pass_fit`): a step of N query tokens costs
        slot_seconds · N · (slots - reference_slots) more than its profiled cell. None for either: no term."""
        ok = slot_seconds is not None and slots is not None and math.isfinite(slot_seconds) and slot_seconds >= 0
        self._context = (float(slot_seconds), int(slots)) if ok else None

    def context_seconds(self, tokens, slots: int | None = None):
        """Seconds `tokens` query tokens (a number or an array) pay for attending over `slots` cache slots per
        row (None: those of `set_context`) beyond the table's reference context (negative when fewer); None
        without a reference context or a priced one."""
        if self.reference_slots is None or self._context is None:
            return None
        per_slot, now = self._context
        return per_slot * tokens * ((now if slots is None else slots) - self.reference_slots)

    def observe_overhead(self, seconds: float, batch: int, tokens: int, prefill_seconds: float = 0.0) -> None:
        """Fold one step's time outside its round (`prefill_seconds` of it prefilling new requests), with its
        rows and committed tokens, into `overhead`."""
        self.overhead.observe(seconds, batch, tokens, prefill_seconds)

    def _scale(self, key: tuple | None, kind: str) -> float:
        """Online correction factor of a cell (see `observe`)."""
        return math.exp(self._cell_log(key, kind))

    def _kind_log(self, kind: str) -> float:
        if kind not in self._kinds:
            return self._level
        mean, level_then, count, _ = self._kinds[kind]
        return mean if self._count - count <= self.stale_after else mean + (self._level - level_then)

    def _cell_log(self, key: tuple | None, kind: str) -> float:
        """The log correction of a cell: its own while fresh; a stale one moved with its parent (a drafted
        cell's batch row, a row's or plain cell's machine-wide level) since; a new one its parent's (a row
        never measured: its kind's)."""
        if key is None:
            return self._kind_log(kind)
        parent = key[:2] if len(key) == 3 else None
        if key not in self._cells:
            return self._cell_log(parent, kind) if parent is not None else self._kind_log(kind)
        mean, parent_then, count, _ = self._cells[key]
        if self._count - count <= self.stale_after:
            return mean
        return mean + ((self._cell_log(parent, kind) if parent is not None else self._level) - parent_then)

    # -- online correction ----------------------------------------------------------------------------
    def observe(self, batch: int, tokens: int, seconds: float, drafted: bool, width: int | None = None,
                slots: int | None = None) -> None:
        """Fold a measured step time into the model (a drafted step's, drafting `width` slots, first brought to
        the profiled width by `width_saving`; one whose pass attended over `slots` cache slots per row, first
        brought to the reference context by `context_seconds`).

        Exponentially forgetting means of log(measured / table), in a hierarchy: per cell (a drafted step of
        one batch row and profiled N, or a batch row's plain step), per batch row of drafted steps, per step
        kind (drafted, plain: the prior of a row not measured yet) and a machine-wide level.

        The level is the drift of a machine that slows down (other load): how far one reference row's
        correction moved since it became the reference, the reference being the batch row (drafted or plain)
        with the most measurements lately (a count halving every REFERENCE_HALF_LIFE measurements; another row
        takes over when it has twice as many, the level carrying on from where it was). So while one kind alone
        has been measured, the other follows its measurements. Following one row's whole correction, its
        relearning after a pause included, keeps the level within the range that row spans: an earlier version
        summed every row's changes while measured but not its relearning, and trends that recur within each
        visit of a row (rounds getting cheaper along a burst of 16 requests, the reset falling in the
        relearning) ratcheted it without bound (-0.21 in log after minutes of serving at 16 clients, pricing
        stale plain steps at 0.81x of what they took; -4 in 2,000 steps of a test world).

        An entry not measured in the last `stale_after` steps moves with its parent from its last measurement
        on (a cell with its row, a row or plain cell with the level), so a slowdown seen by one kind of step
        moves the other too, while every row keeps its own offset from the table: serving inflates drafted
        rounds more than plain ones, by how much depending on the load. A new or stale entry learns its mean
        over its first 1 / alpha measurements (a running mean from its prior) without moving the level, so
        costs learned at 64 requests do not leak into those of 4 requests. A ratio is clamped to [1/20, 20], and
        one more than 2x away from its cell's estimate counts as 2x unless the row's last measurement was as
        far off the same way (`STALL_LOG`), so one stall cannot swing the model; after a lasting change the
        correction is within 5% of it after about ten steps.
        """
        if not (math.isfinite(seconds) and seconds > 0):
            return
        context = self.context_seconds(tokens if drafted else batch, slots) if slots is not None else None
        if context is not None:
            seconds = max(seconds - context, 0.5 * seconds)
        if drafted:
            seconds += self.width_saving(batch, width)
            base, idx = self._base_many(batch, np.array([tokens]))
            key = ("d", self._cells_of(batch, np.array([tokens]))[0], int(idx[0]))
            table = float(base[0])
        else:
            around = self._plain_around(batch)
            key, table = ("p", around[0][0]), sum(self.plain[b] * w for b, w in around)
        log_ratio = math.log(min(20.0, max(0.05, seconds / table)))
        kind, a = key[0], self.alpha
        kind_now = self._kind_log(kind)
        seen = self._kinds[kind][3] if kind in self._kinds else 0
        first_kind = all(k == kind for k in self._kinds)
        chain = [key[:2], key] if len(key) == 3 else [key]  # the row first: a cell's parent
        before = {k: (self._cell_log(k, kind), self._runs(k)) for k in chain}
        self._count += 1
        # a deviation beyond STALL_LOG from the cell's estimate counts only when the row's last one went as far the
        # same way (a lasting change); alone it is taken as a stall and moves every entry as STALL_LOG would
        off = log_ratio - before[key][0]
        outlier = 0 if abs(off) <= self.STALL_LOG else (1 if off > 0 else -1)
        stall = self.STALL_LOG if outlier and self._outliers.get(chain[0], 0) != outlier else math.inf
        self.stalls += stall < math.inf
        self._outliers[chain[0]] = outlier
        if first_kind or seen >= 1 / a:
            kind_new = kind_now + a * _capped(log_ratio - kind_now, stall)
        else:  # another kind's first measurements (a running mean) learn its own offset
            kind_new = kind_now + (log_ratio - kind_now) / (seen + 1)
        self._kinds[kind] = (kind_new, self._level, self._count, seen + 1)
        parent_new = self._level
        for k in chain:
            now, runs = before[k]
            if seen == 0 and not first_kind:  # the other kind's first entries start at its first measurement
                new = kind_new
            else:  # a running mean from the prior over a new (or stale) entry's first measurements, then
                # forgetting; the first kind's entries (no prior but the table) forget from the start
                new = now + (a if first_kind else max(a, 1 / (runs + 2))) * _capped(log_ratio - now, stall)
            self._cells[k] = (new, parent_new, self._count, runs + 1)
            parent_new = new
        self._follow_reference(chain[0])

    def _row_weight(self, row: tuple) -> float:
        """A batch row's count of measurements, halving every REFERENCE_HALF_LIFE measurements."""
        weight, at = self._row_weights.get(row, (0.0, self._count))
        return weight * 0.5 ** ((self._count - at) / self.REFERENCE_HALF_LIFE)

    def _follow_reference(self, row: tuple) -> None:
        """After a measurement of batch row `row`: count it, let it become the level's reference when it has
        twice the reference's count, and move the level with the reference's correction."""
        self._row_weights[row] = (self._row_weight(row) + 1.0, self._count)
        if self._reference != row and (self._reference is None
                                       or self._row_weight(row) > 2 * self._row_weight(self._reference)):
            self._reference, self._reference_base = row, (self._level, self._cells[row][0])
        if self._reference == row:
            level_then, row_then = self._reference_base
            self._level = level_then + (self._cells[row][0] - row_then)

    def _runs(self, key: tuple) -> int:
        """Measurements of an entry since it was new or last went stale."""
        entry = self._cells.get(key)
        return entry[3] if entry is not None and self._count - entry[2] <= self.stale_after else 0

    def measured_recently(self, drafted: bool) -> bool:
        """Whether steps of that kind (drafted or plain) were measured within the last `stale_after` steps."""
        entry = self._kinds.get("d" if drafted else "p")
        return entry is not None and self._count - entry[2] <= self.stale_after

    def plain_measured(self, batch: int, recently: bool = False) -> bool:
        """Whether a plain step of `batch` requests (its profiled row) has ever been measured (`recently`: within
        the last `stale_after` measurements, so that its correction is its own rather than one moved with the
        level since)."""
        key = ("p", self._plain_key(batch)[0])
        return self._runs(key) > 0 if recently else key in self._cells

    # -- (de)serialisation ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The table as JSON-ready data (online corrections are not saved)."""
        out = {"layout": self.layout, "plain": {str(b): s for b, s in sorted(self.plain.items())},
               "drafted": {str(b): [[n, s] for n, s in c] for b, c in sorted(self.drafted.items())}}
        if self.draft_slot and self.width is not None:
            out["draft_slot"] = {str(b): s for b, s in sorted(self.draft_slot.items())}
            out["width"] = self.width
        return out

    @classmethod
    def from_dict(cls, data: dict, where: str = "cost model") -> "CostModel":
        """Build from `to_dict` output; a missing or malformed field fails naming it."""
        for key in ("plain", "drafted"):
            if not isinstance(data.get(key), dict) or not data[key]:
                raise ValueError(f"{where}: field {key!r} is missing or empty")
        slots, width = data.get("draft_slot", {}), data.get("width")
        if not isinstance(slots, dict) or (width is not None and (not isinstance(width, int) or isinstance(width, bool))):
            raise ValueError(f"{where}: field 'draft_slot' must be an object and 'width' an integer")
        try:
            drafted = {int(b): [(int(n), float(s)) for n, s in cells] for b, cells in data["drafted"].items()}
            plain = {int(b): float(s) for b, s in data["plain"].items()}
            draft_slot = {int(b): float(s) for b, s in slots.items()}
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: malformed table ({err})") from None
        try:
            return cls(drafted, plain, data.get("layout", "padded"), draft_slot=draft_slot, width=width)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None


def _envelope(seconds: np.ndarray) -> np.ndarray:
    """The largest non-decreasing curve under `seconds`: each entry the minimum of itself and all later ones."""
    return np.minimum.accumulate(seconds[::-1])[::-1]


def uniform_cost_model(gamma: int = 7, batches: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
                       draft_share: float = 0.2, per_token: float = 0.002, layout: str = "ragged",
                       slot_fraction: float = 0.0) -> CostModel:
    """A synthetic memory-bound-then-compute-bound curve (for tests and the simulator's defaults).

    A plain step of B requests costs 1 + per_token·B; drafting γ slots adds draft_share of a plain step, and
    verification adds per_token per query token. slot_fraction of the drafting cost grows with the drafted
    width (`CostModel.draft_slot`; 0: the width costs nothing).
    """
    drafted, plain, slots = {}, {}, {}
    for b in batches:
        plain[b] = 1.0 + per_token * b
        top = b * (gamma + 1)
        drafted[b] = [(n, 1.0 + draft_share * (1 + per_token * b) + per_token * n) for n in range(b, top + 1)]
        slots[b] = slot_fraction * draft_share * (1 + per_token * b) / max(1, gamma)
    return CostModel(drafted, plain, layout, draft_slot=slots if slot_fraction else {},
                     width=gamma if slot_fraction else None)


# ------------------------------------------------------------------------------------------------------
# pure policies


def _as_numpy(x, dtype=np.float64) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def fixed_lengths(k: int, limits: Sequence[int]) -> np.ndarray:
    """Every request verifies min(k, its limit) drafts."""
    return np.minimum(int(k), _as_numpy(limits, np.int64))


def threshold_lengths(survival, limits: Sequence[int], theta: float) -> np.ndarray:
    """Verify while a[r, k] ≥ θ (the leading run of such positions), within each request's limit."""
    a = _as_numpy(survival)
    lim = _as_numpy(limits, np.int64)
    if a.size == 0:
        return np.zeros(len(lim), dtype=np.int64)
    run = np.cumprod(a >= theta, axis=1).sum(1)
    return np.minimum(run, lim)


def batch_table_lengths(table: dict[int, int], limits: Sequence[int]) -> np.ndarray:
    """vLLM-style dynamic speculation: K from the entry of the largest batch size ≤ the number of requests."""
    lim = _as_numpy(limits, np.int64)
    keys = sorted(table)
    fitting = [b for b in keys if b <= len(lim)]
    k = table[fitting[-1]] if fitting else table[keys[0]]
    return np.minimum(k, lim)


def admission_order(survival, limits: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidates (r, k) with k ≤ limit[r] and a[r, k] > 0 in decreasing survival, ties by position then row.

    Returns (rows, positions (1-based), survivals) in admission order.
    """
    a = _as_numpy(survival)
    lim = _as_numpy(limits, np.int64)
    if a.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0)
    rows, cols = np.nonzero((np.arange(a.shape[1])[None, :] < lim[:, None]) & (a > 0))
    vals = a[rows, cols]
    order = np.lexsort((rows, cols, -vals))  # last key is primary: survival down, then position, then row
    return rows[order], cols[order] + 1, vals[order]


def _drafted_width(survival) -> int | None:
    """The drafted width of a step whose survivals are `survival` [R, w] (what its drafting call cost)."""
    a = survival if isinstance(survival, np.ndarray) else _as_numpy(survival)
    return int(a.shape[1]) if a.ndim == 2 else None


def _path(survival, limits, cost: CostModel, token_budget: int | None):
    """Admission path: rows, positions, survivals, tokens N_j, seconds for j = 0..M admitted, and (padded
    layout) the seconds of a step at each width w = 0..max limit, which the cut reads too. Steps are priced
    as drafting the survival matrix's width (`CostModel.width_saving`)."""
    lim = _as_numpy(limits, np.int64)
    return _priced_path(*admission_order(survival, lim), lim, cost, token_budget, _drafted_width(survival))


def _priced_path(rows: np.ndarray, pos: np.ndarray, vals: np.ndarray, lim: np.ndarray, cost: CostModel,
                 token_budget: int | None, drafted: int | None):
    """`_path` from candidates already in admission order, priced as steps drafting `drafted` slots."""
    num = len(lim)
    width_seconds = None
    if cost.layout == "ragged":
        tokens = num + np.arange(len(rows) + 1)
    else:
        width = np.maximum.accumulate(np.concatenate([[0], pos]))
        tokens = num * (1 + width)
    if token_budget is not None:
        fits = tokens <= max(token_budget, num)
        stop = len(fits) if fits.all() else int(np.argmin(fits))
        rows, pos, vals, tokens = rows[: max(0, stop - 1)], pos[: max(0, stop - 1)], vals[: max(0, stop - 1)], tokens[:stop]
    if cost.layout == "ragged":
        seconds = cost.cost_many(num, tokens, drafted)
    else:  # every padded step is one of max limit + 1 widths: price those once
        width_seconds = cost.cost_many(num, num * (1 + np.arange(int(lim.max(initial=0)) + 1)), drafted)
        seconds = width_seconds[tokens // num - 1]
    return rows, pos, vals, tokens, seconds, width_seconds


def _lengths_from(rows: np.ndarray, count: int, num: int) -> np.ndarray:
    return np.bincount(rows[:count], minlength=num).astype(np.int64)


def _plateau_room(lim: np.ndarray, tokens: np.ndarray, cost: CostModel,
                  width_seconds: np.ndarray | None = None) -> np.ndarray:
    """room[j]: how many drafts a step can hold at the cost of path step j, counted from what the limits
    allow (never from later candidates, whose survivals may depend on earlier drafts). width_seconds: the
    padded layout's step seconds at each width 0..max limit (`_path`)."""
    num = len(lim)
    if cost.layout == "ragged":
        ends = cost.cell_end_many(num, tokens)
        return np.minimum(ends, num + lim.sum()) - num
    # padded: every row may grow to the widest width whose step costs the same
    widths = np.arange(int(lim.max(initial=0)) + 1)
    width_cost = cost.cost_many(num, num * (1 + widths)) if width_seconds is None else width_seconds
    widest = np.where(width_cost[:, None] == width_cost[None, :], widths[None, :], -1).max(1)  # same cost
    room_at_width = np.minimum(lim[None, :], widest[:, None]).sum(1)
    return room_at_width[tokens // num - 1]


def _best_continuation(tau_before: float, v: float, admitted: int, width: int, lim: np.ndarray, cost: CostModel,
                       max_tokens: int | None, width_seconds: np.ndarray | None = None,
                       drafted: int | None = None) -> float:
    """Upper bound on Θ of any step that admits the next candidate (survival v) after `admitted` others, and
    maybe more: every later candidate survives at most v, and the limits (not later candidates) say how
    many there can be. Ragged: every added draft is a token; padded: a step of width w holds
    Σ min(limit, w) drafts for w ≥ `width` (the width with the candidate), priced by `width_seconds` where
    given (`_path`), else as steps drafting `drafted` slots. Reads v, the limits and the costs."""
    num = len(lim)
    if cost.layout == "ragged":
        extra = np.arange(1, int(lim.sum()) - admitted + 1)
        tokens = num + admitted + extra
    else:
        widths = np.arange(max(width, 1), int(lim.max(initial=0)) + 1)
        extra = np.minimum(lim[None, :], widths[:, None]).sum(1) - admitted
        tokens = num * (1 + widths)
    keep = extra >= 1
    if max_tokens is not None:
        keep &= tokens <= max(max_tokens, num)
    if not keep.any():
        return -math.inf
    extra, tokens = extra[keep], tokens[keep]
    if cost.layout == "ragged" or width_seconds is None:
        seconds = cost.cost_many(num, tokens, drafted)
    else:
        seconds = width_seconds[tokens // num - 1]
    return float(np.max((tau_before + extra * v) / seconds))


def _prefix_cut(vals: np.ndarray, tokens: np.ndarray, seconds: np.ndarray, lim: np.ndarray, cost: CostModel,
                pos: np.ndarray, max_tokens: int | None, width_seconds: np.ndarray | None = None,
                drafted: int | None = None) -> int:
    """How many candidates of the path Algorithm 1 admits (see prefix_schedule); `drafted`: the step's drafted
    width, which prices it."""
    num = len(lim)
    tau = num + np.concatenate([[0.0], np.cumsum(vals)])
    theta = tau / seconds
    if len(theta) <= 1:
        return 0
    best_before = np.maximum.accumulate(theta)[:-1]  # Θ_best while considering candidate j (1-based)
    crossing = seconds[1:] != seconds[:-1]
    room = _plateau_room(lim, tokens[1:], cost, width_seconds) - np.arange(len(vals))  # slots left from j on
    upper = (tau[:-1] + np.maximum(room, 1) * vals) / seconds[1:]  # later candidates survive at most vals[j]
    widths = np.maximum.accumulate(pos)  # the padded width with candidates 1..j
    for j in np.nonzero(crossing & (upper <= best_before))[0]:
        # filling the cell candidate j opens cannot beat Θ_best. Where that cell holds one draft (a smooth
        # curve) this is the paper's stop; a cell of several (a stepped curve) is opened anyway when a
        # costlier cell further on, filled at survival vals[j], could beat Θ_best (a one-off jump, such as
        # leaving the CUDA graphs, followed by cheap tokens)
        if room[j] <= 1:
            return int(j)
        if _best_continuation(tau[j], vals[j], int(j), int(widths[j]), lim, cost, max_tokens,
                              width_seconds, drafted) <= best_before[j]:
            return int(j)
    return len(vals)


def prefix_schedule(survival, limits: Sequence[int], cost: CostModel,
                    token_budget: int | None = None, by_width: bool = True) -> tuple[np.ndarray, float]:
    """Algorithm 1 (DSpark): admit candidates in decreasing survival while the step's expected throughput
    Θ = E[committed tokens] / cost can still rise; stop at the first candidate that cannot raise it.

    On a smooth curve this is the paper's rule (stop at the first Θ ≤ Θ_best). On a stepped curve (CUDA-graph
    sizes, or dspark's padded batch where a wider row costs a whole column) a candidate that opens a
    costlier cell is admitted when filling that cell, or any costlier cell after it, could beat Θ_best,
    bounding every later candidate's survival by its own (the order is decreasing) and their number by the
    limits; candidates inside an already-paid cell are free. The look-ahead past the opened cell pays where
    a one-off jump (leaving the CUDA graphs) is followed by cheap tokens, and costs Θ where the later
    survivals fall short of the bound. Either way the cut at candidate j reads candidates 1..j only and the limits, never a later one: every
    request's admitted set is a prefix decided before its next draft is looked at (lossless).

    In the padded layout (`by_width`, the default) the candidates are taken a whole column at a time instead
    (`_width_cut`): a step's cost there depends on its widest row only, so each width's Θ is computed exactly
    rather than bounded by its first candidate's survival. Returns the per-request lengths and the expected Θ
    (tokens per second) of the chosen step.
    """
    lim = _as_numpy(limits, np.int64)
    num = len(lim)
    if cost.layout == "padded" and by_width:
        return _width_cut(_as_numpy(survival), lim, cost, token_budget)
    rows, pos, vals, tokens, seconds, width_seconds = _path(survival, lim, cost, token_budget)
    count = _prefix_cut(vals, tokens, seconds, lim, cost, pos, token_budget, width_seconds,
                        _drafted_width(survival))
    tau = num + vals[:count].sum()
    return _lengths_from(rows, count, num), float(tau / seconds[count])


def _width_cut(a: np.ndarray, lim: np.ndarray, cost: CostModel,
               token_budget: int | None = None) -> tuple[np.ndarray, float]:
    """Algorithm 1 in the padded layout, one width at a time: every row verifies min(limit, w) drafts, and
    width w opens while the step with it, or with a wider one, could beat the step at the width opened
    before (Θ strictly higher; ties keep the narrower).

    A padded step costs the same whichever rows fill its width, so width w's Θ is exact: (B + Σ_r Σ_{k ≤
    min(w, limit_r)} a[r, k]) / cost(B·(1 + w)). A wider width w' is bounded by letting every draft past w
    survive at its row's survival at w (survivals are non-increasing along a block), so a stepped curve's
    cheap cells after a jump are still reached. Admission by single candidates (`_prefix_cut`) bounds a width
    by its first candidate's survival, the highest: at 16 requests, temperature 1, it opened widths whose
    whole step was slower than a narrower one's in about half the planned steps (2% of Θ at 8–32 requests,
    under its own costs).

    Non-anticipating: opening width w reads a[:, ≤ w] only, and a[r, w] depends on drafts 1..w−1 of row r
    (other rows are other requests), so whether draft k of row r is verified never reads x_k or a later draft.
    """
    num = len(lim)
    width = int(min(lim.max(initial=0), a.shape[1] if a.ndim == 2 else 0))
    widths = np.arange(width + 1)
    if token_budget is not None:  # a width whose step does not fit the budget is never opened
        fits = num * (1 + widths) <= max(token_budget, num)
        width = int(widths[fits].max(initial=0))
        widths = widths[: width + 1]
    seconds = cost.cost_many(num, num * (1 + widths), _drafted_width(a))
    if width == 0:
        return np.zeros(num, dtype=np.int64), float(num / seconds[0])
    a = a[:, :width]
    reach = np.arange(1, width + 1)[None, :] <= lim[:, None]  # [R, w]: draft k of row r is available
    tau = num + np.concatenate([[0.0], np.cumsum((a * reach).sum(0))])  # τ at widths 0..width
    # later[i, j]: Σ_r a[r, i]·[draft j + 1 available], the bound's tokens in column j + 1 at the survival of i + 1
    later = a.T @ reach.astype(a.dtype)
    opened = 0
    for w in range(1, width + 1):
        extra = np.concatenate([[0.0], np.cumsum(later[w - 1, w:])])  # tokens past w, widths w .. width
        bound = float(np.max((tau[w] + extra) / seconds[w:]))
        if bound <= tau[opened] / seconds[opened]:
            break
        opened = w
    return np.minimum(lim, opened).astype(np.int64), float(tau[opened] / seconds[opened])


def best_capacity(survival, limits: Sequence[int], cost: CostModel, token_budget: int | None = None) -> tuple[int, float]:
    """Unconstrained global search along the admission path: (number of drafts at the best Θ, that Θ).

    It reads the whole path, so it must only be applied to survivals of steps already finished
    (`dspark-async` uses those of two steps before); on the current block it would anticipate.
    """
    lim = _as_numpy(limits, np.int64)
    _, _, vals, _, seconds, _ = _path(survival, lim, cost, token_budget)
    theta = (len(lim) + np.concatenate([[0.0], np.cumsum(vals)])) / seconds
    best = int(np.argmax(theta))
    return best, float(theta[best])


def best_width(survival, limits: Sequence[int], cost: CostModel, token_budget: int | None = None) -> int:
    """The drafted width w (1 .. the survival matrix's width) whose best step is fastest: for each w, the
    highest Θ over the admission path of the candidates at positions ≤ w, every step priced as drafting w
    slots (`CostModel.width_saving`); the narrowest such w on ties.

    It reads the whole matrix, so it must only be applied to survivals of steps already finished (an adaptive
    policy chooses the next step's width from the last planned step's); on the current block it would
    anticipate.
    """
    a = _as_numpy(survival)
    lim = _as_numpy(limits, np.int64)
    if a.ndim != 2 or a.shape[1] == 0 or not len(lim):
        return max(1, a.shape[-1] if a.ndim == 2 else 1)
    num, width = len(lim), a.shape[1]
    _, pos, vals = admission_order(a, lim)  # a narrower block's path is this one's candidates at positions ≤ w
    # every step any width's path can take, priced once at the profiled width, then per drafted width by its
    # slots as `CostModel.cost_many` does: ragged, by the candidates admitted; padded, by the step's width
    grid = num + np.arange(len(vals) + 1) if cost.layout == "ragged" else num * (1 + np.arange(width + 1))
    fixed = cost.overhead.fixed(num)
    core = cost.cost_many(num, grid) - fixed
    best, best_theta = 1, -math.inf
    for w in range(1, width + 1):
        saving = cost.width_saving(num, w)
        prices = (np.maximum(core - saving, 0.5 * core) if saving else core) + fixed
        keep = pos <= w
        v = vals[keep]
        at = np.arange(len(v) + 1) if cost.layout == "ragged" else np.maximum.accumulate(
            np.concatenate([[0], pos[keep]]))
        tau = num + np.concatenate([[0.0], np.cumsum(v)])
        if token_budget is not None:
            fits = grid[at] <= max(token_budget, num)
            stop = len(fits) if fits.all() else int(np.argmin(fits))
            tau, at = tau[:stop], at[:stop]
        theta = float(np.max(tau / prices[at]))
        if theta > best_theta * (1 + 1e-9):
            best, best_theta = w, theta
    return best


def top_capacity(survival, limits: Sequence[int], capacity: int, cost: CostModel | None = None,
                 token_budget: int | None = None) -> np.ndarray:
    """Admit the first `capacity` candidates of the admission order (a capacity fixed before the step)."""
    lim = _as_numpy(limits, np.int64)
    if cost is not None and token_budget is not None:
        rows, *_ = _path(survival, lim, cost, token_budget)
        capacity = min(capacity, len(rows))
    else:
        rows, _, _ = admission_order(survival, lim)
    return _lengths_from(rows, max(0, int(capacity)), len(lim))


def cap_to_budget(lengths: np.ndarray, token_budget: int | None, layout: str) -> np.ndarray:
    """Shorten the longest requests (ties: the later row) until the step fits the token budget."""
    out = np.array(lengths, dtype=np.int64)
    if token_budget is None or out.size == 0:
        return out
    while step_tokens(out, layout) > max(token_budget, out.size) and out.max() > 0:
        r = int(len(out) - 1 - np.argmax(out[::-1]))
        out[r] -= 1
    return out


# ------------------------------------------------------------------------------------------------------
# stateful wrapper


@dataclass
class StepPlan:
    """Per-request verification lengths of one step, with what the policy expected of it."""

    lengths: list[int]
    expected_throughput: float | None = None
    capacity: int | None = None


class Scheduler:
    """A named policy plus its state. The decoding loop calls `wants_drafts` before drafting, then `plan`.

    name: "none" | "fixed:K" | "threshold:θ" | "batch-table[:B=K,...]" | "dspark" | "dspark-async".
    Adaptive policies ("dspark", "dspark-async") skip drafting when their best schedules are expected
    slower than plain decoding (smoothed over steps, with a margin either way: SWITCH_MARGIN), for a back-off
    of 4 steps that grows fourfold while drafting keeps not paying (up to `max_backoff`), then probe again; a back-off ends when the batch
    size moves over 2x away from the one it was decided at. A probe is skipped too while
    Algorithm 1 on the workload's typical survival row (the mean row of drafted steps, averaged over about
    the last 1 / SURVIVAL_SMOOTHING of them, so a few hard steps do not stand for the workload; corrected per
    batch bucket by what probes there found, until the workload becomes easier) still predicts no gain at the
    current batch size and costs, so a batch where drafting never pays probes once per `max_backoff` steps. That gate is read as soon as a probe
    is within `wake_lead` steps, from the step that decides a back-off on, so a back-off where drafting does
    not pay is `dormant` (the drafter may sleep) from its start. An adaptive policy whose online-corrected
    cost model has measured drafted steps runs one plain step (a plain probe) at a batch size whose plain steps it
    never measured, and, while
    its smoothed gain is below PLAIN_CHECK_GAIN, when no plain step of that batch row (and none at all) was
    measured in the model's last `stale_after` steps: its comparison then reads plain costs as measured under
    the same load.

    An adaptive policy also chooses how many slots the next step drafts (`draft_limit`), before drafting and
    from the last planned step only (non-anticipating): the width at which that step's survivals gave the
    fastest step, each width priced by the drafter's per-slot cost (`best_width`), one slot wider when that
    was the whole drafted width (so a narrowed width can grow back), and the whole block until a step has
    been planned. Gains are judged at the best width too.
    """

    #: weight of a drafted step in the smoothed gain
    SMOOTHING = 0.3
    #: weight of a drafted step's mean survival row in the typical row that gates probes
    SURVIVAL_SMOOTHING = 0.05
    #: a typical row expecting over this many times the accepted drafts it expected when a batch bucket's gate
    #: correction was learned voids the correction (`_gate_correction`)
    GATE_EASIER = 1.2
    #: expected relative gain of drafting below which the policy calls itself unsure (`unsure`)
    UNSURE_GAIN = 0.5
    #: expected relative gain of drafting below which a plain step's cost at the batch size is measured again
    #: once its last measurement is stale (`wants_drafts`). The gain is judged against that cost: at 64 clients,
    #: temperature 1, one plain probe read 1.4x its neighbours and, its cell stale and moving with the drafted
    #: rows' level after, priced plain rounds 1.5x what they took (79 against 50 ms), a gain of 0.57 in log
    #: where drafting gained nothing; a policy that probes only while unsure (gain below 0.41) never checked it.
    #: A plain probe at 64 clients costs about a third of a drafted step's time.
    PLAIN_CHECK_GAIN = 1.0
    #: log-gain a change of mode needs (hysteresis): drafting stops once the smoothed gain falls below
    #: -SWITCH_MARGIN, and a probe (the first drafted step after a back-off) resumes drafting only at a gain of at
    #: least +SWITCH_MARGIN, which the probe gate asks of the typical row too (`_predicted_to_pay`). Near break-even
    #: each mode alone is level, and switching is what costs: served at 64 clients, temperature 1, probes read
    #: -0.035, -0.018 and -0.014 where the smoothed gain had held 0.3-0.4, and each sent the drafter to sleep for a
    #: back-off whose awake end and late-joined rows cost the cell 0.74-0.78x of no speculation, where drafting
    #: throughout gave 0.89-1.06x and backing off throughout 0.87x (`benchmarks/results/serving/fused_part/`).
    SWITCH_MARGIN = 0.05
    #: drafted steps after which a plan skipped as not paying (`plan_pays`) runs again
    PLAN_REFRESH = 16
    #: weight of a planned step in the smoothed advantage of planning and in its measured own work
    PLAN_SMOOTHING = 0.1

    def __init__(self, spec: str, gamma: int, max_backoff: int = 256) -> None:
        self.spec = spec
        self.gamma = gamma
        self.kind, self.param = parse_policy(spec, gamma)
        self.max_backoff = max_backoff
        self._skip = 0
        self._backoff = 4
        self._ends: list[int] = []  # remaining back-off lengths at which probes skipped ahead would have come
        self._backoff_rows = 0  # the batch size at which the current back-off was decided
        self._gain: float | None = None
        self._gain_rows = 0  # the batch size of the step that last replaced the smoothed gain
        self._probing = False
        self._since_probe = 0
        self._last_cost: CostModel | None = None
        self._last_mean: np.ndarray | None = None
        # per batch bucket: log-gain by which probes beat the typical row, and the typical row's expected accepted
        # drafts when it was learned (`_gate_correction`)
        self._gate_bias: dict[int, tuple[float, float]] = {}
        self._history: deque[dict[int, np.ndarray]] = deque(maxlen=2)
        self.drafted_steps = 0
        self.skipped_steps = 0
        self.plain_probes = 0
        self._advantage: dict[int, float] = {}  # per batch bucket: smoothed log(Θ of the plan / Θ of the full block)
        self._full_seconds: dict[int, float] = {}  # per batch bucket: the full block's step cost at its last plan
        self._own_seconds: float | None = None  # smoothed seconds a planned step spends on planning
        self._unplanned = 0  # drafted steps since the last plan
        self._gain_bucket = 0  # the batch bucket of the last planned step (where `_gain` was last updated)
        self.skipped_plans = 0
        self._width: int | None = None  # an adaptive policy's next drafted width (None: the whole block)
        #: padded layout: Algorithm 1 opens whole widths (`_width_cut`); False admits single candidates, as the
        #: ragged layout does (kept for side-by-side runs: `interleaved_arms.py`'s `+pathcut` arms)
        self.by_width = True

    @property
    def needs_survival(self) -> bool:
        """Whether `plan` reads survival estimates."""
        return self.kind in ("threshold", "dspark", "dspark-async")

    @property
    def needs_cost(self) -> bool:
        """Whether `plan` reads the cost model."""
        return self.kind in ("dspark", "dspark-async")

    @property
    def adaptive(self) -> bool:
        """Whether the policy may skip drafting when it does not pay."""
        return self.kind in ("dspark", "dspark-async")

    @property
    def unsure(self) -> bool:
        """Whether the smoothed expected gain of drafting over plain decoding is small (below UNSURE_GAIN, or
        not known yet): where measuring plain decoding against drafting is worth its time."""
        return self._gain_below(self.UNSURE_GAIN)

    def _gain_below(self, relative: float) -> bool:
        """Whether the smoothed expected gain is below log(1 + relative), or not known yet."""
        return self._gain is None or self._gain < math.log1p(relative)

    @property
    def draft_limit(self) -> int | None:
        """How many slots the next step needs drafted, decided before drafting: fixed:K verifies at most K; an
        adaptive policy drafts the width its last planned step found fastest (see the class docstring). None:
        the whole block."""
        if self.kind == "fixed":
            return self.param
        return self._width if self.adaptive else None

    @property
    def never_drafts(self) -> bool:
        """Whether the policy verifies no drafts at any step (`none`, `fixed:0`)."""
        return self.kind == "none" or (self.kind == "fixed" and self.param == 0)

    @property
    def dormant(self) -> bool:
        """Whether an adaptive policy is far into a back-off: more than `max_backoff // 4` steps without
        drafting lie ahead, so the decoding loop may let the drafter drop its per-request upkeep (its context
        of target features) and rebuild it for the requests that join before the next probe."""
        return self.adaptive and self._skip > self.wake_lead

    @property
    def expected_gain(self) -> float | None:
        """An adaptive policy's smoothed expected log-gain of drafting over plain decoding (None: not known yet,
        or not adaptive); a back-off starts when it falls below -SWITCH_MARGIN (below +SWITCH_MARGIN at a probe)."""
        return self._gain if self.adaptive else None

    @property
    def backoff_left(self) -> int:
        """Steps left in the current back-off (0: none)."""
        return self._skip

    def gate_bias(self, num_rows: int) -> float | None:
        """The correction probes taught the probe gate at `num_rows`'s batch bucket, as the gate reads it now
        (`_gate_correction`; None: none yet)."""
        return self._gate_correction(num_rows) if _bucket(num_rows) in self._gate_bias else None

    @property
    def wake_lead(self) -> int:
        """Steps before a probe at which a sleeping drafter wakes (`dormant` ends), so that the requests
        joining meanwhile have drafter context by the probe."""
        return self.max_backoff // 4

    def rejudge(self, num_rows: int, fresh: bool = False) -> None:
        """End a back-off decided at a batch size over 2x away from `num_rows` (called by `wants_drafts` and
        `idle_step`; a loop whose drafter sleeps calls it at the start of a step, before admitting requests), or
        any back-off when `fresh`: the batch starts anew after the decoding loop went idle, so the load the
        back-off was decided at is gone."""
        if self._skip > 0 and (fresh or not self._backoff_rows / 2 <= num_rows <= 2 * self._backoff_rows):
            # the back-off was decided at another load (over 2x apart, so that a batch hovering at its client
            # count does not reset it): drafting's worth changes with the batch size, so this batch is judged
            # afresh (a probe, unless the typical survivals predict no gain here either)
            self._skip, self._backoff, self._probing, self._since_probe, self._ends = 0, 4, True, 0, []
            self._backoff_rows = num_rows

    def idle_step(self, num_rows: int) -> None:
        """A step the decoding loop runs without drafting whatever the policy says (no row can draft, e.g.
        while the drafter sleeps): a back-off counts down, and ends when the batch size moves over 2x, but no
        probe is started."""
        if self.never_drafts:
            return
        self.rejudge(num_rows)
        if self._skip > 0:
            self._count_down(num_rows)

    def _count_down(self, num_rows: int) -> None:
        """One skipped step of a back-off. Its probe is judged ahead (`_look_ahead`); where a back-off skipped
        that way would have ended, the typical survivals are read again, and if they now predict a gain (the
        costs were corrected meanwhile) the back-off ends there, as it would have without the look-ahead."""
        self._skip -= 1
        self.skipped_steps += 1
        if self._ends and self._skip == self._ends[0]:  # `_ends` is in the order they come (descending)
            self._ends.pop(0)
            if self._predicted_to_pay(num_rows):
                # probe now; or, where a drafter may sleep (`dormant`), after waking it `wake_lead` steps
                # ahead, so that the rows joining meanwhile have its context by the probe
                self._skip, self._ends = min(self._skip, self.wake_lead) if self.dormant else 0, []
                return
        if self._skip == self.wake_lead:
            self._look_ahead(num_rows)

    def _look_ahead(self, num_rows: int) -> None:
        """Judge the probe that ends the back-off once it is at most `wake_lead` steps away, rather than at its
        end: while the typical survivals predict no gain at this batch size, extend the back-off at once (4x
        longer each time, up to the longest time without a probe). So a back-off decided where drafting does
        not pay is known to be long from its first step, and a loop whose drafter sleeps (`dormant`) lets it
        sleep from then on, and does not wake it for a probe that would be skipped anyway."""
        while 0 < self._skip <= self.wake_lead and self._probe_skippable(num_rows):
            self._extend_backoff()

    def _extend_backoff(self) -> None:
        """Skip the probe that ends the current back-off: add a back-off of its length, the next one 4x longer
        (the skipped probe's place is kept in `_ends`, to be judged again when it comes)."""
        self._since_probe += self._backoff
        self._ends = [end + self._backoff for end in self._ends]
        if self._skip > 0:
            self._ends.append(self._backoff)
        self._skip += self._backoff
        self._backoff = min(self.max_backoff, self._backoff * 4)

    def _probe_skippable(self, num_rows: int) -> bool:
        """Whether the probe that ends the current back-off would be skipped: the typical survival row still
        predicts no gain at this batch size and the longest time without a probe has not passed."""
        return self._probing and self._since_probe < self.max_backoff and not self._predicted_to_pay(num_rows)

    def wants_drafts(self, num_rows: int) -> bool:
        """Whether the coming step should call the drafter at all."""
        if self.never_drafts:
            return False
        self.rejudge(num_rows)
        if self._skip > 0:
            self._count_down(num_rows)
            return False
        if self._probe_skippable(num_rows):
            # the last drafted step's survivals still say drafting cannot pay at this batch size under the
            # current (online-corrected) costs: keep skipping without paying for a probe
            self._extend_backoff()
            self._skip -= 1  # this step is the back-off's first
            self.skipped_steps += 1
            self._look_ahead(num_rows)
            return False
        cost = self._last_cost
        if self.adaptive and cost is not None and cost.measured_recently(True) and (
                not cost.plain_measured(num_rows)
                or (self._gain_below(self.PLAIN_CHECK_GAIN) and not cost.plain_measured(num_rows, True)
                    and not cost.measured_recently(False))):
            # the online-corrected costs compare measured drafted steps with plain ones never measured at this
            # batch size, or not lately while the call is close: one plain step measures them (serving can
            # inflate drafted rounds more than plain ones, and a stale plain cost moves with drafted rows); at
            # most one such step per `stale_after` measurements, however the batch size moves between rows
            self.plain_probes += 1
            return False
        self._since_probe = 0
        self.drafted_steps += 1
        return True

    def observe_own_work(self, seconds: float) -> None:
        """Fold the seconds a planned step spent on planning (its block's signals, survival, Algorithm 1 and the
        online calibrator's observations, as the decoding loop measures them) into what `plan_pays` weighs."""
        if math.isfinite(seconds) and seconds >= 0:
            own = self._own_seconds
            self._own_seconds = seconds if own is None else own + self.PLAN_SMOOTHING * (seconds - own)

    def plan_pays(self, limits: Sequence[int], cost: CostModel | None, token_budget: int | None = None) -> bool:
        """Whether a drafted `dspark` step should compute survivals and plan, rather than verify every available
        draft within the budget (`full_plan`).

        Planning costs time a fixed policy does not spend, and at some batch sizes Algorithm 1 almost never
        cuts enough to earn it back (on a flat cost curve, where a longer block costs next to nothing). So the
        plan's expected advantage, log(Θ of the plan / Θ of the full block) under the step's survivals and
        costs, smoothed over planned steps of this batch size's bucket (1, 2, 3-4, 5-8, ...), is weighed
        against its measured own work as a share of the full block's step at the bucket's last plan,
        log(1 + own / cost): below it the plan is skipped, for at most PLAN_REFRESH drafted steps in a row
        before one runs again. Never while `unsure` (the gain that backs drafting off comes from plans) or
        before both are measured, and never at a batch bucket other than the last planned step's (a skipped plan
        does not update the gain that backs drafting off, and that gain changes with the batch size: a batch
        that grew from 8 to 64 requests must find out at once that drafting stopped paying). Reads past steps
        and the costs only: a skipped plan verifies what a fixed policy would (lossless). Costs no cost-model
        lookup (a few dictionary reads). Never while the drafted width is narrower than the drafter's block: the
        width comes from plans, so a skipped plan would keep a narrow width for PLAN_REFRESH steps, and the
        advantage measured at it (a plan against the narrow block) says nothing of the whole block (one client at
        temperature 0 over HTTP verified 3.0 drafts a step where fixed K = 7 verified 6.7).
        """
        if self.kind != "dspark" or cost is None or self._own_seconds is None or self.unsure:
            return True
        if self._width is not None and self._width < self.gamma:
            return True
        key = _bucket(len(limits))
        advantage = self._advantage.get(key)
        if advantage is None or self._unplanned >= self.PLAN_REFRESH or not len(limits) or key != self._gain_bucket:
            return True
        if advantage >= math.log1p(self._own_seconds / self._full_seconds[key]):
            return True
        self._unplanned += 1
        self.skipped_plans += 1
        return False

    def full_plan(self, limits: Sequence[int], cost: CostModel | None, token_budget: int | None = None) -> StepPlan:
        """Every available draft, within the token budget: the plan of a step whose planning does not pay."""
        layout = cost.layout if cost is not None else "padded"
        return StepPlan(cap_to_budget(_as_numpy(limits, np.int64), token_budget, layout).tolist())

    def _note_advantage(self, a: np.ndarray, lim: np.ndarray, cost: CostModel, token_budget: int | None,
                        theta: float) -> None:
        """Smooth log(Θ of the plan / Θ of the full block) into this batch bucket's advantage (`plan_pays`)."""
        full = cap_to_budget(lim, token_budget, cost.layout)
        reach = np.arange(a.shape[1])[None, :] < full[:, None]
        seconds = cost.cost(len(lim), step_tokens(full, cost.layout), a.shape[1])
        advantage = math.log(max(theta, 1e-300) * seconds / max(len(lim) + float(a[reach].sum()), 1e-300))
        key = _bucket(len(lim))
        old = self._advantage.get(key)
        self._advantage[key] = advantage if old is None else old + self.PLAN_SMOOTHING * (advantage - old)
        self._full_seconds[key] = seconds
        self._unplanned = 0

    def _predicted_to_pay(self, num_rows: int) -> bool:
        """Whether Algorithm 1 on the typical survival row of past drafted steps, repeated for `num_rows`
        requests, beats plain decoding by SWITCH_MARGIN, after the correction that probes at this batch bucket
        taught (`_typical_gain`; survivals of finished steps only: non-anticipating)."""
        if self._last_cost is None or self._last_mean is None:
            return True
        return self._typical_gain(num_rows, self._last_cost) + self._gate_correction(num_rows) >= self.SWITCH_MARGIN

    def _gate_correction(self, num_rows: int) -> float:
        """The gate's correction at `num_rows`'s batch bucket: what probes there found against the typical row,
        unless the workload has since become easier: a typical row expecting over GATE_EASIER times the accepted
        drafts it expected when the correction was learned makes it void (0) until the next probe there. A
        correction learned while drafting did not pay says nothing of an easier workload: served at temperature 1
        and then 0 (the sweep's order), probes at 33-64 requests had closed the gate there at temperature 1, and at
        temperature 0, where drafting paid (K = 3 1.09x of no speculation), the server drafted in 47% and 48% of its
        rounds at 32 and 64 clients, a probe once per `max_backoff` steps. A harder workload keeps the correction."""
        bias, expected_then = self._gate_bias.get(_bucket(num_rows), (0.0, 0.0))
        if self._last_mean is not None and float(self._last_mean.sum()) > self.GATE_EASIER * expected_then:
            return 0.0
        return bias

    def _typical_gain(self, num_rows: int, cost: CostModel) -> float:
        """log(Θ / Θ of plain decoding) of Algorithm 1 on the typical row repeated for `num_rows` requests, at
        the row's best drafted width."""
        return _row_gain(self._last_mean, num_rows, cost)

    def _note_probe(self, num: int, gain: float, cost: CostModel) -> None:
        """After a probe (the first drafted step after a back-off), learn how far its own expected gain fell from
        what the typical row predicted at its batch size (before this step joined the row): the gate's
        correction at this batch bucket. The typical row is a mean over steps of every batch size, and what it
        predicts can be far off at one load (measured at 64 requests and temperature 1: it predicted a gain where
        probes kept finding log-gains of -0.3 to -0.6, so a probe was paid for every few dozen steps). A probe
        weighs like `num` single-request steps (weight 1 - (1 - SURVIVAL_SMOOTHING)^num): one probe of 64
        requests nearly sets the correction, a hard step of one request hardly moves it."""
        if not self._probing or self._last_mean is None or num == 0:
            return
        error = gain - self._typical_gain(num, cost)
        key = _bucket(num)
        weight = 1.0 - (1.0 - self.SURVIVAL_SMOOTHING) ** num
        old = self._gate_correction(num)  # a void correction is not carried into the new one
        self._gate_bias[key] = (old + weight * (error - old), float(self._last_mean.sum()))

    def plan(self, survival, limits: Sequence[int], cost: CostModel | None = None, token_budget: int | None = None,
             request_ids: Sequence[int] | None = None) -> StepPlan:
        """Per-request lengths for a step whose block was drafted (survival [R, γ]; None when not needed)."""
        lim = _as_numpy(limits, np.int64)
        num = len(lim)
        layout = cost.layout if cost is not None else "padded"
        if self.kind == "none" or num == 0:
            return StepPlan([0] * num)
        if self.kind == "fixed":
            return StepPlan(cap_to_budget(fixed_lengths(self.param, lim), token_budget, layout).tolist())
        if self.kind == "batch-table":
            return StepPlan(cap_to_budget(batch_table_lengths(self.param, lim), token_budget, layout).tolist())
        if survival is None:
            raise ValueError(f"scheduler {self.spec!r} needs survival estimates")
        a = _as_numpy(survival)
        if self.kind == "threshold":
            return StepPlan(cap_to_budget(threshold_lengths(a, lim, self.param), token_budget, layout).tolist())
        if cost is None:
            raise ValueError(f"scheduler {self.spec!r} needs a cost model")
        ids = list(range(num)) if request_ids is None else list(request_ids)
        stale = self._history[0] if len(self._history) == 2 else None
        whole = self._whole_width(a)
        self._history.append({i: whole[r] for r, i in enumerate(ids)})
        if self.kind == "dspark" or stale is None:
            lengths, theta = prefix_schedule(a, lim, cost, token_budget, self.by_width)
            capacity = int(lengths.sum())
            if self.kind == "dspark":
                self._note_advantage(a, lim, cost, token_budget, theta)
        else:  # dspark-async: capacity from survivals two steps old (at this step's width), admitted by current survival
            fallback = np.mean(list(stale.values()), axis=0)
            old = np.stack([stale.get(i, fallback) for i in ids])[:, : a.shape[1]]
            capacity, theta = best_capacity(old, lim, cost, token_budget)
            lengths = top_capacity(a, lim, capacity, cost, token_budget)
        # the next step's width, from this finished block's survivals: every row that could draft counted at the
        # block's whole width (a row near its token limit says nothing of what the next rows will need)
        width = best_width(a, np.where(lim > 0, a.shape[1], 0), cost, token_budget)
        self._width = min(self.gamma, width + 1) if width >= a.shape[1] else width
        self._last_cost = cost
        gain = _log_gain(theta, cost.plain_cost(num), num)
        if self.adaptive and self._probing and (lim > 0).any():
            # a probe judges drafting at this load by the rows that could draft (see _drafting_rows_gain)
            gain = self._drafting_rows_gain(a, lim, num, cost)
            self._note_probe(num, gain, cost)
        self._note_typical(a, lim)
        self._after_plan(gain, num)
        return StepPlan(lengths.tolist(), theta, capacity)

    def _whole_width(self, a: np.ndarray) -> np.ndarray:
        """Survivals [R, w] of a block drafted `w` slots wide as [R, γ] (zero past w: no such drafts)."""
        if a.shape[1] >= self.gamma:
            return a
        whole = np.zeros((a.shape[0], self.gamma), dtype=a.dtype)
        whole[:, : a.shape[1]] = a
        return whole

    def _drafting_rows_gain(self, a: np.ndarray, lim: np.ndarray, num: int, cost: CostModel) -> float:
        """The step's gain had every row drafted like the rows that could: Algorithm 1 on their mean survival
        row (position k over the rows with a draft k available) repeated for `num` requests. Rows without
        drafter context (admitted while the drafter slept), at their token limit or with speculation off verify
        nothing this step, which says nothing of what drafting is worth at this load."""
        mean, _ = _drafting_mean(a, lim)
        return _row_gain(np.minimum.accumulate(np.nan_to_num(mean, nan=0.0)), num, cost)

    def _note_typical(self, a: np.ndarray, lim: np.ndarray) -> None:
        """Smooth a drafted step's mean survival row into the typical row that gates probes. Position k
        averages the rows that had a draft k available (a row near its token limit, or one without drafter
        context, shows zeros there that say nothing of the workload); a position no row had keeps its value (zero
        at first)."""
        if not len(a) or not a.shape[1]:
            return
        # a narrower block says nothing of the positions past it: they keep their typical value
        mean, count = _drafting_mean(self._whole_width(a), np.minimum(lim, a.shape[1]))
        if self._last_mean is None or self._last_mean.shape != mean.shape:
            typical = np.nan_to_num(mean, nan=0.0)
        else:
            typical = np.where(count > 0, self._last_mean + self.SURVIVAL_SMOOTHING * (mean - self._last_mean),
                               self._last_mean)
        self._last_mean = np.minimum.accumulate(typical)  # survival of a longer prefix is never higher

    def _after_plan(self, gain: float, num: int) -> None:
        """Back off from drafting while the expected gain of drafting over plain decoding is below -SWITCH_MARGIN
        (below +SWITCH_MARGIN at a probe: a back-off ends only where drafting clearly pays).

        The gain is log(Θ_best / Θ_plain), smoothed over drafted steps (weight SMOOTHING) so one hard round does
        not stop drafting; the first step after a pause (a probe) replaces the smoothed value, and so does a step
        whose batch is over 2x away from the one where the value was last replaced (drafting's worth changes with
        the load: a batch filling from 8 to 64 requests must not draft on at 64 on the strength of the gain at 8).
        """
        if not self.adaptive:
            return
        self._gain_bucket = _bucket(num)
        if self._gain is None or self._probing or not self._gain_rows / 2 <= num <= 2 * self._gain_rows:
            self._gain, self._gain_rows = gain, num
        else:
            self._gain += self.SMOOTHING * (gain - self._gain)
        probe, self._probing = self._probing, False
        if self._gain < (self.SWITCH_MARGIN if probe else -self.SWITCH_MARGIN):  # hysteresis: see SWITCH_MARGIN
            self._backoff_rows = num
            self._skip, self._ends = self._backoff, []
            self._backoff = min(self.max_backoff, self._backoff * 4)
            self._probing = True
            self._look_ahead(num)
        else:
            self._backoff = 4


def _capped(delta: float, bound: float) -> float:
    """`delta` clipped to [-bound, bound]."""
    return min(bound, max(-bound, delta))


def _drafting_mean(a: np.ndarray, lim: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean survival per draft position over the rows that had that draft available (NaN where none had), and
    how many had it."""
    seen = np.arange(a.shape[1])[None, :] < lim[:, None]
    count = seen.sum(0)
    return np.where(count > 0, (a * seen).sum(0) / np.maximum(count, 1), np.nan), count


def _row_gain(row: np.ndarray, num_rows: int, cost: CostModel) -> float:
    """log(Θ / Θ of plain decoding) of Algorithm 1 on survival `row` repeated for `num_rows` requests, drafted
    at the width among 1 .. len(row) where that is highest (each priced as drafting that many slots)."""
    a = np.repeat(row[None, :], num_rows, axis=0)
    widths = range(1, a.shape[1] + 1) if a.shape[1] > 1 and cost.width_saving(num_rows, 1) else [a.shape[1]]
    theta = max(prefix_schedule(a[:, :w], np.full(num_rows, w), cost)[1] for w in widths)
    return _log_gain(theta, cost.plain_cost(num_rows), num_rows)


def _log_gain(theta: float, plain_seconds: float, num_rows: int) -> float:
    """log(Θ / Θ of plain decoding): the expected gain of a step of `num_rows` requests over a plain one."""
    return math.log(max(theta, 1e-12) * plain_seconds / num_rows)


def _bucket(num_rows: int) -> int:
    """The power of two at or above `num_rows`: batch sizes whose plans are judged together."""
    return 1 << max(0, int(num_rows) - 1).bit_length()


def parse_policy(spec: str, gamma: int) -> tuple[str, object]:
    """Parse a scheduler name into (kind, parameter); a bad name or value fails naming it and the range."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"scheduler must be one of {', '.join(POLICIES)}; got {spec!r}")
    name, _, arg = spec.partition(":")
    if name in ("none", "dspark", "dspark-async"):
        if arg:
            raise ValueError(f"scheduler {name!r} takes no parameter, got {spec!r}")
        return name, None
    if name == "fixed":
        if not arg:
            return "fixed", gamma
        try:
            k = int(arg)
        except ValueError:
            raise ValueError(f"scheduler fixed:K needs an integer K in [0, {gamma}], got {arg!r}") from None
        if not 0 <= k <= gamma:
            raise ValueError(f"scheduler fixed:K needs K in [0, {gamma}] (the drafter's block), got {k}")
        return "fixed", k
    if name == "threshold":
        try:
            theta = float(arg)
        except ValueError:
            raise ValueError(f"scheduler threshold:θ needs a number θ in (0, 1], got {arg!r}") from None
        if not 0.0 < theta <= 1.0:
            raise ValueError(f"scheduler threshold:θ needs θ in (0, 1], got {theta}")
        return "threshold", theta
    if name == "batch-table":
        if not arg:  # shrink K as the batch grows, as vLLM's dynamic speculation does
            table = {1: gamma, 4: min(gamma, 4), 16: min(gamma, 2), 64: 1}
            return "batch-table", table
        table = {}
        for item in arg.split(","):
            b, _, k = item.partition("=")
            try:
                table[int(b)] = int(k)
            except ValueError:
                raise ValueError(f"scheduler batch-table needs entries B=K separated by commas, got {item!r}") from None
            if int(b) < 1 or not 0 <= int(k) <= gamma:
                raise ValueError(f"batch-table entry {item!r}: need B >= 1 and K in [0, {gamma}]")
        return "batch-table", table
    raise ValueError(f"unknown scheduler {spec!r}; choose one of {', '.join(POLICIES)}")
