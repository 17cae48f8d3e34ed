"""benchmarks/step_log_passes.py: a step log's target passes by kind (drafted / plain, fused / not)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from dspark.engine.engine import StepInfo
from dspark.engine.steplog import StepLog, read_step_log

_spec = importlib.util.spec_from_file_location(
    "step_log_passes", Path(__file__).resolve().parent.parent / "benchmarks" / "step_log_passes.py")
step_log_passes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_log_passes)


def _step(batch: int, drafted: bool, fused: bool, target: float, slots: float, width: int = 1) -> StepInfo:
    return StepInfo(batch, batch * width, drafted, target + 0.002, [width - 1] * batch,
                    prefill_tokens=40 if fused else 0, target_seconds=target, step_seconds=target + 0.004,
                    kv_slots=slots, fused_prefill=fused, cpu_seconds=target + 0.003,
                    draft_width=7 if drafted else None)


def test_passes_are_summarised_per_kind_and_brought_to_the_reference_rows(tmp_path, capsys) -> None:
    log = StepLog(tmp_path / "steps.jsonl")
    for info in ([_step(32, False, False, 0.020, 300)] * 3 + [_step(64, False, True, 0.050, 400)] * 2
                 + [_step(64, True, True, 0.100, 420, width=4)] + [_step(8, True, False, 0.5, 100, width=2)]):
        log(info)
    log.close()
    rows = step_log_passes.pass_rows(read_step_log(tmp_path / "steps.jsonl"), min_batch=16)
    assert [(r["drafted"], r["fused"], r["steps"]) for r in rows] == [(False, False, 3), (False, True, 2),
                                                                     (True, True, 1)]  # the 8-row step is out
    plain, fused, drafted = rows
    assert plain["target_ms"] == pytest.approx(40.0)  # 20 ms at 32 rows is 40 per 64
    assert fused["target_ms"] == pytest.approx(50.0) and fused["prompt_tokens"] == 40
    assert drafted["tokens_per_row"] == 4 and drafted["slots"] == 420
    assert plain["cpu_share"] == pytest.approx(0.023 / 0.024)
    assert step_log_passes.main([str(tmp_path / "steps.jsonl"), "--min-batch", "16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[0].startswith("steps.jsonl: plain, unfused: 3 steps, target 40.0 ms per 64 rows")
