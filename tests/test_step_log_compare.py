"""benchmarks/step_log_compare.py: per-arm means over the full steps of a step log."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "step_log_compare", Path(__file__).resolve().parent.parent / "benchmarks" / "step_log_compare.py")
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


def _step(started, batch, verified, accepted, step=0.02):
    return {"started": started, "batch": batch, "verified": verified, "accepted": accepted, "step_seconds": step,
            "seconds": step - 0.002, "target_seconds": 0.012, "draft_seconds": 0.004, "schedule_seconds": 0.0005,
            "prefill_seconds": 0.001}


def test_means_count_only_full_steps_and_tokens_include_the_gaps(tmp_path, capsys):
    steps = [_step(0.0, 2, 0, 0), _step(0.03, 8, 16, 8), _step(0.06, 8, 24, 4), _step(0.09, 3, 0, 0)]
    path = tmp_path / "log.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(s) + "\n" for s in steps)
    m = compare.summarize(compare.read_log(path), 6)
    assert m["steps"] == 2 and m["rows"] == 8
    assert m["verified_per_row"] == pytest.approx(40 / 16) and m["accepted_per_row"] == pytest.approx(12 / 16)
    assert m["gap_ms"] == pytest.approx(10.0)  # 30 ms apart, 20 ms steps
    assert m["tokens_per_s"] == pytest.approx((16 + 12) / (0.04 + 0.02))
    compare.main([str(path)])
    assert "log.jsonl.gz" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no step has 9 rows"):
        compare.summarize(steps, 9)
