"""Whether drafting pays, measured on whole steps: the engine's throughput with and without drafting, compared.

The adaptive schedulers decide from a step-cost model. Near break-even that model can be right about every
round and still wrong about the run: drafting changes what the *other* work of the engine costs (how many
prompts join per step, how the padded cache grows, how the serving threads share the cores), and none of that
is in the cost of a round. The guard measures what the model cannot: committed tokens per second of wall time
over windows of whole steps, in the two modes, at the same load.

It runs windows of at least `window_seconds` and `min_steps` steps, each in one mode (drafting as the scheduler
decides, or no drafting at all), after `settle_seconds` in that mode that it does not count: a switch leaves
the other mode's transient behind it (drafting steps finish requests three times as fast as plain ones, so a
plain window that follows drafting inherits a queue of prompts to prefill), and what is compared is each
mode's steady rate. It keeps an exponentially smoothed rate per mode and per load, and exploits the faster
mode. A load is the window's mean running rows (power-of-two buckets) and its share of greedy rows (none,
mixed, all): greedy and sampled requests accept drafts at very different rates, so what was learnt on one
does not decide for the other. It explores the other mode for one window
after `gap` exploiting windows; the gap doubles (up to `max_gap`) each time exploring confirms the choice, and
falls back to 1 when it overturns it. While drafting is exploited it explores only when the caller says the
model is unsure (its expected gain of drafting is small); at large predicted gains no plain window is paid.

Non-anticipating by construction: the mode of a step depends only on earlier steps' timings and counts, never
on the step's drafts, so every output stays lossless.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class _Load:
    """What the guard knows at one load (a bucket of running rows)."""

    rate: dict[bool, float] = field(default_factory=dict)  # smoothed tokens / s per mode (True: drafting)
    exploit: bool = True
    gap: int = 1
    since: int = 0  # exploiting windows since the last exploration


class RateGuard:
    """Chooses, window by window, whether the engine drafts at all; `drafting` is the current window's mode.

    window_seconds, min_steps: a window's least length; settle_seconds: time after a switch of mode that no
    window counts. margin: the relative rate lead the explored mode needs
    to take over. smoothing: weight of a new window in a mode's rate. max_gap: exploiting windows between
    explorations at most.
    """

    def __init__(self, window_seconds: float = 3.0, min_steps: int = 4, margin: float = 0.03,
                 smoothing: float = 0.5, max_gap: int = 32, settle_seconds: float = 1.0) -> None:
        if (not window_seconds > 0 or min_steps < 1 or not 0 <= margin < 1 or not 0 < smoothing <= 1 or max_gap < 1
                or not settle_seconds >= 0):
            raise ValueError(f"bad RateGuard settings: window_seconds={window_seconds}, min_steps={min_steps}, "
                             f"margin={margin}, smoothing={smoothing}, max_gap={max_gap}, "
                             f"settle_seconds={settle_seconds}")
        self.window_seconds, self.min_steps, self.margin = window_seconds, min_steps, margin
        self.settle_seconds = settle_seconds
        self._settle = 0.0  # time still to pass uncounted in the current mode
        self.smoothing, self.max_gap = smoothing, max_gap
        self.drafting = True
        self._exploring = False
        self._loads: dict[int, _Load] = {}
        self._seconds = 0.0
        self._tokens = 0
        self._steps = 0
        self._row_sum = 0
        self._greedy_sum = 0.0
        self.windows = 0
        self.plain_windows = 0

    @staticmethod
    def bucket(rows: float, greedy: float = 0.0) -> tuple[int, int]:
        """The load of a window: its mean running rows in powers of two, and its greedy share as 0 (no greedy
        row), 1 (mixed) or 2 (all greedy)."""
        mix = 0 if greedy <= 0.1 else 2 if greedy >= 0.9 else 1
        return int(round(math.log2(max(rows, 1.0)))), mix

    def rates(self, rows: float, greedy: float = 0.0) -> dict[bool, float]:
        """The smoothed rates (tokens / s) known at this load, by mode (True: drafting)."""
        load = self._loads.get(self.bucket(rows, greedy))
        return dict(load.rate) if load is not None else {}

    def discard(self) -> None:
        """Drop the window in progress (the engine went idle: its time is not the mode's)."""
        self._seconds, self._tokens, self._steps, self._row_sum, self._greedy_sum = 0.0, 0, 0, 0, 0.0

    def record(self, seconds: float, tokens: int, rows: int, unsure: bool = True, greedy: float = 0.0) -> None:
        """One finished step in the current mode: its period (start to the next step's start), the tokens it
        committed, its running rows and their greedy share. unsure: whether the cost model's expected gain of
        drafting is small enough that measuring plain decoding is worth a window."""
        if seconds < 0 or tokens < 0 or rows < 0 or not 0 <= greedy <= 1:
            raise ValueError(f"a step cannot take {seconds} s, commit {tokens} tokens, run {rows} rows or have a "
                             f"greedy share of {greedy}")
        if self._settle > 0:
            self._settle -= seconds
            return
        self._seconds += seconds
        self._tokens += tokens
        self._steps += 1
        self._row_sum += rows
        self._greedy_sum += greedy
        if self._seconds < self.window_seconds or self._steps < self.min_steps:
            return
        rate = self._tokens / self._seconds if self._seconds > 0 else 0.0
        load = self._loads.setdefault(self.bucket(self._row_sum / self._steps, self._greedy_sum / self._steps),
                                      _Load())
        mode = self.drafting
        old = load.rate.get(mode)
        load.rate[mode] = rate if old is None else old + self.smoothing * (rate - old)
        self.windows += 1
        self.plain_windows += not mode
        self.discard()
        if self._exploring:
            self._exploring = False
            other = load.rate.get(not load.exploit)
            if other is not None and other > load.rate.get(load.exploit, 0.0) * (1 + self.margin):
                load.exploit, load.gap = not load.exploit, 1
            else:
                load.gap = min(self.max_gap, 2 * load.gap)
            load.since = 0
        elif mode == load.exploit:
            load.since += 1
        else:  # a window of the other mode that was not an exploration (the load moved between buckets)
            load.since = 0
        explore = load.since >= load.gap and (unsure or not load.exploit)
        self._exploring = explore
        mode = load.exploit != explore
        if mode != self.drafting:
            self._settle = self.settle_seconds
        self.drafting = mode
