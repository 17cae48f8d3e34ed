"""benchmarks/step_log_compare.py: per-arm figures over the full steps of a step log."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "step_log_compare", Path(__file__).resolve().parent.parent / "benchmarks" / "step_log_compare.py")
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


def _step(started, batch, verified, accepted, step=0.02):
    return {"started": started, "batch": batch, "verified": verified, "accepted": accepted, "step_seconds": step,
            "seconds": step - 0.002, "target_seconds": 0.012, "draft_seconds": 0.004, "schedule_seconds": 0.0005,
            "prefill_seconds": 0.001, "drafted": True, "planned": False}


def test_only_full_steps_count_and_tokens_per_second_include_the_gaps(tmp_path, capsys):
    steps = [_step(0.0, 2, 0, 0), _step(0.03, 8, 16, 8), _step(0.06, 8, 24, 4), _step(0.09, 3, 0, 0)]
    path = tmp_path / "log.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(s) + "\n" for s in steps)
    line = compare.summary(steps, 6)
    assert line.startswith("steps 2, tokens/request-step 1.75, verified/request-step 2.50")
    assert "per step: rows 8.0, step 20.0 ms, drafting 4.0, scheduling 0.50, target 12.0" in line
    assert "accepted/request-step 0.75" in line
    assert line.endswith(f"tokens/s with gaps {(16 + 12) / (0.04 + 0.02):.0f}")  # 30 ms apart, 20 ms steps
    assert compare.summary(steps, 9) == "no steps"
    assert compare.main([f"arm={path}", "--min-batch", "6"]) == 0
    assert f"arm: {line}" in capsys.readouterr().out


def test_logs_with_the_threads_cpu_time_show_the_wait():
    """Steps that record the engine thread's CPU time add how long of each step it waited (wall − CPU)."""
    steps = [{**_step(0.0, 8, 16, 8), "cpu_seconds": 0.017}, {**_step(0.03, 8, 16, 8), "cpu_seconds": 0.015}]
    assert "step 20.0 ms, of which waited 4.0, drafting" in compare.summary(steps, 6)
    steps[1].pop("cpu_seconds")  # a log written before the field: no waiting figure rather than a wrong one
    assert "waited" not in compare.summary(steps, 6)
