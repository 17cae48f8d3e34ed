"""Time the process spends in Python's cyclic garbage collector, for the engine's per-step record.

A collection runs in whichever thread's allocation trips the collector's thresholds and holds the interpreter
lock throughout, so a collection anywhere in the process (the HTTP event loop's, the engine thread's) stalls a
decoding step. A full (generation 2) collection walks every tracked object: 150 ms over the ~400,000 objects of
the bundled target, drafter and tokenizer on this machine, which is why `dspark serve` freezes the objects
alive at start-up out of its reach (`dspark.serving.cli.freeze_heap`). The clock counts every collection's
seconds and the full ones; the engine reads it at a step's start and end (`StepInfo.gc_seconds`, `gc_full`).
"""
from __future__ import annotations

import gc
import time


class GcClock:
    """Seconds spent in garbage collections, and the number of full ones, since it was installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._start: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        if self._start is not None:  # one collection at a time: it holds the interpreter lock
            self.seconds += time.perf_counter() - self._start
            self._start = None
            if info.get("generation") == 2:
                self.full += 1


_clock: GcClock | None = None


def gc_clock() -> GcClock:
    """The process's clock, installed in `gc.callbacks` on first use."""
    global _clock
    if _clock is None:
        _clock = GcClock()
        gc.callbacks.append(_clock)
    return _clock
