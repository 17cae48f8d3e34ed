"""benchmarks/drafting_bound.py: Algorithm 1's best gain over plain decoding from a profile and measured survival."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from dspark.scheduling import uniform_cost_model

_spec = importlib.util.spec_from_file_location(
    "drafting_bound", Path(__file__).resolve().parent.parent / "benchmarks" / "drafting_bound.py")
drafting_bound = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(drafting_bound)


def test_the_bound_falls_with_the_batch_and_with_the_survival() -> None:
    cost = uniform_cost_model(gamma=4, batches=(1, 64), per_token=0.02, layout="padded")
    high, low = np.array([0.9, 0.8, 0.7, 0.6]), np.array([0.3, 0.1, 0.03, 0.01])
    one = drafting_bound.best_gain(high[None], cost)
    assert one > 2  # τ up to 4 at a drafting cost of 1.2 + 0.1 plain steps
    assert drafting_bound.best_gain(np.tile(high, (64, 1)), cost) < one  # compute-bound: drafting pays less
    assert drafting_bound.best_gain(low[None], cost) < one
    # a hopeless row: Algorithm 1 verifies nothing and the drafted step still pays the drafter's call
    assert drafting_bound.best_gain(np.tile(low, (64, 1)), cost) < 1


def test_survival_rows_come_from_a_bench_json_and_a_missing_drafter_is_named(tmp_path) -> None:
    bench = tmp_path / "bench.json"
    runs = [{"drafter": "dspark", "temperature": 1.0, "domain": d, "cumulative_acceptance": [0.8, 0.5]}
            for d in ("code", "prose")] + [{"drafter": "none", "temperature": 1.0, "domain": "code",
                                             "cumulative_acceptance": []}]
    bench.write_text(json.dumps({"runs": runs}))
    rows = drafting_bound.survival_rows(str(bench), "dspark", 1.0)
    assert set(rows) == {"code", "prose"} and rows["code"].tolist() == [0.8, 0.5]
    with pytest.raises(SystemExit, match="no survival for drafter 'eagle3' at temperature 1"):
        drafting_bound.survival_rows(str(bench), "eagle3", 1.0)
