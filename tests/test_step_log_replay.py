"""benchmarks/step_log_replay.py: a step log replayed through a fresh cost model."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from dspark.engine.engine import StepInfo
from dspark.engine.steplog import StepLog, read_step_log
from dspark.scheduling import uniform_cost_model

_spec = importlib.util.spec_from_file_location(
    "step_log_replay", Path(__file__).resolve().parent.parent / "benchmarks" / "step_log_replay.py")
step_log_replay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_log_replay)


def test_the_replay_prices_plain_rounds_as_the_logged_ones_taught_it(tmp_path) -> None:
    """Plain rounds of 64 rows logged at 1.5x the table: the replayed plain cell's correction moves to log 1.5,
    and the price the replay gives before each round is the one the model held then."""
    table = uniform_cost_model(gamma=7, batches=(16, 64), draft_share=1.0, per_token=0.01, layout="padded")
    plain = table.plain_cost(64)
    log = StepLog(tmp_path / "steps.jsonl")
    for _ in range(24):
        log(StepInfo(64, 64, False, 1.5 * plain, [0] * 64, predicted_seconds=plain, target_seconds=plain,
                     step_seconds=1.6 * plain, kv_slots=0.0))
    log(StepInfo(64, 64, False, 1.5 * plain, [0] * 64, predicted_seconds=None, target_seconds=plain))  # no cost model
    log.close()
    steps = read_step_log(tmp_path / "steps.jsonl")
    cost = uniform_cost_model(gamma=7, batches=(16, 64), draft_share=1.0, per_token=0.01, layout="padded")
    out = list(step_log_replay.replay(steps, cost, 64))
    assert len(out) == 25 and out[0]["price"] == pytest.approx(plain) and out[0]["cell"] is None
    assert out[-1]["cell"][0] == pytest.approx(math.log(1.5), abs=0.01)
    assert out[-1]["price"] == pytest.approx(1.5 * plain, rel=0.01)
    assert cost.plain_cost(64) == pytest.approx(out[-1]["price"])  # the unpriced last round taught nothing
