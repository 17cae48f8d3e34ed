"""The engine's per-step log (`dspark serve --step-log`): one record per step, consistent with the step, and
a reader that survives a writer killed mid-line."""
from __future__ import annotations

import gzip
import json

import pytest

import dspark
from dspark.api import encode_prompt
from dspark.engine import Engine, Request
from dspark.engine.prefill import prefill_width
from dspark.engine.steplog import StepLog, chain, read_step_log
from dspark.evaluation.bench import load_eval_prompts
from dspark.sampling import SamplingParams
from dspark.scheduling import Scheduler, uniform_cost_model


def test_every_step_is_logged_with_its_figures(bundled_target, tmp_path):
    drafter = dspark.load_drafter("dspark", bundled_target)
    cost = uniform_cost_model(7, range(1, 9))
    seen = []
    log = StepLog(tmp_path / "steps.jsonl", flush_every=1000)  # the close flushes
    engine = Engine(bundled_target, drafter, "dspark", cost, on_step=chain(seen.append, None, log))
    prompts = [encode_prompt(bundled_target, t) for t in load_eval_prompts("code", 3)]
    for i, p in enumerate(prompts):
        engine.add(Request(p, SamplingParams(temperature=float(i % 2), seed=i), max_tokens=12, request_id=f"r{i}"))
    while engine.has_work:
        engine.step()
    log.close()
    records = read_step_log(tmp_path / "steps.jsonl")
    assert len(records) == len(seen) > 0
    assert any(i.expected_gain is not None for i in seen)  # dspark planned at least one step
    last_end = 0.0
    for rec, info in zip(records, seen):
        assert rec["batch"] == info.batch and rec["tokens"] == info.tokens and rec["drafted"] == info.drafted
        assert rec["verified"] == sum(info.lengths) and rec["accepted"] == sum(info.accepted)
        assert 0 <= rec["accepted"] <= rec["verified"] and rec["fused_prefill"] == info.fused_prefill
        assert rec["draft_width"] == info.draft_width and (rec["draft_width"] is not None) == info.drafted
        assert rec["max_length"] <= (rec["draft_width"] or 0)
        assert rec["started"] >= last_end  # steps do not overlap and come in order
        assert rec["seconds"] <= rec["step_seconds"] + 1e-6
        # the engine thread's CPU time over the step: never more than the step's wall time (with a margin for the
        # clocks' resolution and torch's other threads, whose CPU time thread_time does not count)
        assert rec["cpu_seconds"] == round(info.cpu_seconds, 6) and 0 < rec["cpu_seconds"] <= rec["step_seconds"] + 2e-3
        assert rec["predicted_seconds"] is not None and rec["predicted_seconds"] > 0
        assert rec["plain_predicted_seconds"] is not None and rec["plain_predicted_seconds"] > 0
        if not info.drafted:  # a plain round's prediction is the plain price
            assert rec["plain_predicted_seconds"] == rec["predicted_seconds"]
        assert rec["page_faults"] == info.page_faults and (rec["page_faults"] is None or rec["page_faults"] >= 0)
        assert 0.0 <= rec["sort_seconds"] <= rec["step_seconds"] - rec["seconds"] + 1e-6
        assert rec["gc_full"] == info.gc_full >= 0 and 0.0 <= rec["gc_seconds"] <= rec["step_seconds"] + 1e-6
        # the adaptive scheduler's state after the step: its gain once a step was planned, the back-off it keeps
        assert rec["backoff_left"] == info.backoff_left >= 0
        assert (rec["expected_gain"] is None) == (info.expected_gain is None)
        if info.expected_gain is not None:
            assert rec["expected_gain"] == pytest.approx(info.expected_gain, abs=1e-4)
            assert info.backoff_left == 0 or info.expected_gain < Scheduler.SWITCH_MARGIN or not info.drafted
        last_end = rec["started"] + rec["step_seconds"]
    # every committed token is in the log: each request's first token from its prefill (which fed the whole
    # prompt), then rows + accepted drafts per step
    assert sum(r["prefill_tokens"] for r in records) == sum(len(p) for p in prompts)
    assert len(prompts) + sum(r["batch"] + r["accepted"] for r in records) >= 3 * 12
    # the cache before round 1 holds the prompts that the first prefill pass fed whole (its width maximises
    # prompt tokens per cost; a longer prompt continues in later passes), as wide as the longest of them;
    # later it holds what each row kept, in slots that holes and uneven rows widen
    lengths = [len(p) for p in prompts]
    width = prefill_width(lengths)
    joined = [n for n in lengths if n <= width]
    first = records[0]
    assert first["prefill_slots"] == len(prompts) * width and first["prefill_tokens"] == sum(min(n, width) for n in lengths)
    assert (first["batch"], first["kv_live"], first["kv_slots"]) == (len(joined), sum(joined), max(joined))
    assert 0 < first["join_seconds"] <= first["prefill_seconds"]
    assert sum(r["join_seconds"] > 0 for r in records) <= len(prompts) - len(joined) + 1
    for rec in records[1:]:
        assert 0 < rec["kv_live"] <= rec["kv_slots"] * rec["batch"] and rec["join_seconds"] >= 0.0


def test_the_prediction_is_the_cost_model_before_it_learns_the_step(bundled_target, tmp_path):
    cost = uniform_cost_model(7, range(1, 5))
    seen = []
    engine = Engine(bundled_target, dspark.load_drafter("dspark", bundled_target), "fixed", cost,
                    on_step=seen.append)
    prompt = encode_prompt(bundled_target, load_eval_prompts("prose", 1)[0])
    engine.add(Request(prompt, SamplingParams(), max_tokens=4))
    engine.step()  # prefill + first round
    fresh = uniform_cost_model(7, range(1, 5))
    info = seen[0]
    table = fresh.cost(info.batch, info.tokens) if info.drafted else fresh.plain_cost(info.batch)
    assert info.predicted_seconds == pytest.approx(table)  # no correction before the first measurement


def test_a_line_cut_short_at_the_end_is_skipped_and_one_in_the_middle_fails(tmp_path):
    good = json.dumps({"batch": 1})
    path = tmp_path / "steps.jsonl"
    path.write_text(f"{good}\n{good}\n{{\"batch\": 2, \"tok")
    assert read_step_log(path) == [{"batch": 1}, {"batch": 1}]
    path.write_text(f"{good}\n{{\"batch\": 2, \"tok\n{good}\n")
    with pytest.raises(ValueError, match=r"step log .*steps\.jsonl line 2 is not valid JSON"):
        read_step_log(path)
    packed = tmp_path / "steps.jsonl.gz"  # as kept under benchmarks/results/
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write(f"{good}\n{good}\n")
    assert read_step_log(packed) == [{"batch": 1}, {"batch": 1}]


def test_a_failed_write_ends_the_log_without_failing_the_step(tmp_path, caplog):
    log = StepLog(tmp_path / "steps.jsonl", flush_every=1)
    log._file.close()
    log._file = open("/dev/full", "w")  # every flush fails with ENOSPC
    from dspark.engine import StepInfo

    log(StepInfo(batch=1, tokens=1, drafted=False, seconds=0.01, lengths=[0]))
    assert log._file.closed and "no more steps are recorded" in caplog.text
    log(StepInfo(batch=1, tokens=1, drafted=False, seconds=0.01, lengths=[0]))  # later steps: ignored


def test_page_faults_are_counted_per_thread():
    """Touching fresh memory in one thread shows in that thread's count, not in another's (where the platform
    counts them per thread)."""
    import threading

    import numpy as np

    from dspark.engine.engine import thread_page_faults

    if thread_page_faults() is None:
        pytest.skip("no per-thread page fault counts on this platform")
    counts = {}

    def touch():
        before = thread_page_faults()
        buf = np.ones(256 << 20, dtype=np.uint8)  # 256 MiB, above the mmap threshold: fresh pages
        counts["toucher"] = thread_page_faults() - before
        del buf

    quiet_before = thread_page_faults()
    worker = threading.Thread(target=touch)
    worker.start()
    worker.join()
    quiet = thread_page_faults() - quiet_before
    # at least one fault per 2 MiB (transparent huge pages fault a 2 MiB page at a time, 4 KiB pages 512 times more)
    assert counts["toucher"] >= (256 << 20) // (2 << 20) and quiet < counts["toucher"] // 2


def test_garbage_collections_inside_a_step_are_timed(bundled_target):
    """A collection holds the interpreter lock, so one anywhere in the process stalls the step: the step records
    the seconds spent collecting and how many collections were full ones (here forced inside each step, where it
    looks at the rows' order: a young generation's first, then full ones)."""
    import gc

    from dspark.engine.gc_clock import gc_clock

    clock = gc_clock()
    assert gc_clock() is clock and gc.callbacks.count(clock) == 1  # installed once
    before = clock.full
    gc.collect()
    assert clock.full == before + 1
    seen = []
    engine = Engine(bundled_target, None, "none", on_step=seen.append)
    engine.add(Request(encode_prompt(bundled_target, "def f(x):"), SamplingParams(), max_tokens=6))
    engine.step()  # the prefill (and the first round)
    first = len(seen)
    engine._sort_rows = lambda: gc.collect(0)
    for _ in range(2):
        engine.step()
    young = seen[first:]
    assert len(young) == 2 and all(0 < i.gc_seconds < i.step_seconds and i.gc_full == 0 for i in young)
    engine._sort_rows = gc.collect
    while engine.has_work:
        engine.step()
    full = seen[first + 2:]
    assert full and all(0 < i.gc_seconds < i.step_seconds and i.gc_full == 1 for i in full)
