"""A per-step trace of the engine: one JSON line per decoding step (`dspark serve --step-log FILE`).

Each line holds what `StepInfo` measured (batch, query tokens, drafted or not, round / step / prefill / drafting /
target seconds, the cost model's prediction and its figure for a plain round, drafts verified and accepted, the
target cache's slots per row and live tokens, the time spent joining finished prefills, whether the scheduler
planned the round, the drafted width, an adaptive scheduler's smoothed expected gain, back-off left and gate
correction, the engine thread's CPU time over the step, the accepted drafts a planned round expected, the time spent
reordering the running rows, the engine thread's page faults, the seconds spent in garbage collection and how
many full collections ran) and `started`, the step's start on the process's
perf_counter clock, so that gaps between steps (time the engine thread spent outside `step`: dispatching outputs,
waiting for the interpreter lock) can be read off. The file is appended to while the server runs, a line at a time:
a reader skips a last line cut short by a crash (`read_step_log`).
"""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Callable

from dspark.atomic import read_json_lines
from dspark.engine.engine import StepInfo

log = logging.getLogger("dspark.engine")


def step_record(info: StepInfo) -> dict:
    """The JSON-ready record of one step."""
    return {
        "started": round(info.started, 6), "batch": info.batch, "tokens": info.tokens, "drafted": info.drafted,
        "verified": int(sum(info.lengths)), "accepted": int(sum(info.accepted)),
        "max_length": max(info.lengths, default=0),
        "seconds": round(info.seconds, 6), "step_seconds": round(info.step_seconds, 6),
        "prefill_seconds": round(info.prefill_seconds, 6), "prefill_tokens": info.prefill_tokens,
        "prefill_slots": info.prefill_slots,
        "draft_seconds": round(info.draft_seconds, 6), "schedule_seconds": round(info.schedule_seconds, 6),
        "target_seconds": round(info.target_seconds, 6),
        "predicted_seconds": None if info.predicted_seconds is None else round(info.predicted_seconds, 6),
        "plain_predicted_seconds": (None if info.plain_predicted_seconds is None
                                    else round(info.plain_predicted_seconds, 6)),
        "expected_throughput": info.expected_throughput, "capacity": info.capacity,
        "kv_slots": info.kv_slots, "kv_live": info.kv_live, "join_seconds": round(info.join_seconds, 6),
        "asleep": info.asleep, "blind": info.blind, "planned": info.planned, "fused_prefill": info.fused_prefill,
        "draft_width": info.draft_width,
        "expected_gain": None if info.expected_gain is None else round(info.expected_gain, 4),
        "backoff_left": info.backoff_left,
        "gate_bias": None if info.gate_bias is None else round(info.gate_bias, 4),
        "chunk_seconds": None if info.chunk_seconds is None else round(info.chunk_seconds, 6),
        "cpu_seconds": round(info.cpu_seconds, 6),
        "expected_accepted": None if info.expected_accepted is None else round(info.expected_accepted, 3),
        "sort_seconds": round(info.sort_seconds, 6), "page_faults": info.page_faults,
        "gc_seconds": round(info.gc_seconds, 6), "gc_full": info.gc_full,
    }


class StepLog:
    """An on_step callback that appends `step_record(info)` as one JSON line per step to `path`.

    A write that fails (disk full) is logged and ends the log; it never fails the step."""

    def __init__(self, path: str | Path, flush_every: int = 32) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")
        self._flush_every, self._pending = max(1, int(flush_every)), 0
        self._lock = threading.Lock()

    def __call__(self, info: StepInfo) -> None:
        line = json.dumps(step_record(info), separators=(",", ":")) + "\n"
        with self._lock:
            if self._file.closed:
                return
            try:
                self._file.write(line)
                self._pending += 1
                if self._pending >= self._flush_every:
                    self._file.flush()
                    self._pending = 0
            except OSError as err:
                log.error("step log %s: %s; no more steps are recorded", self.path, err)
                try:
                    self._file.close()
                except OSError:  # the buffered rest cannot be written either
                    pass

    def close(self) -> None:
        """Flush and close the file (later steps are not recorded)."""
        with self._lock:
            if not self._file.closed:
                try:
                    self._file.close()
                except OSError as err:
                    log.error("step log %s: %s while closing", self.path, err)


def read_step_log(path: str | Path) -> list[dict]:
    """The records of a step log; a last line cut short (the writer was killed) is skipped, a bad line
    elsewhere fails naming the file and the line."""
    return [row for _, row in read_json_lines(path, "step log")]


def chain(*callbacks: Callable[[StepInfo], None] | None) -> Callable[[StepInfo], None]:
    """One on_step callback calling each given one in turn (None entries are skipped)."""
    kept = [c for c in callbacks if c is not None]

    def call(info: StepInfo) -> None:
        for c in kept:
            c(info)

    return call
