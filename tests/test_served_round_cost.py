"""benchmarks/served_round_cost.py: served fixed:K rounds against the profile's cells."""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import served_round_cost  # noqa: E402

PROFILE = ROOT / "benchmarks/results/serving/profile_cpu_epyc_v19.json"


def test_rounds_of_each_fixed_k_are_measured_beside_their_profile_cell():
    lines = served_round_cost.measure(str(PROFILE), concurrency=2, ks=[1, 2], temperature=0.0, blocks=2)
    assert len(lines) == 2
    for k, line in zip((1, 2), lines):
        m = re.match(rf"T=0 K={k}: +(\d+) rounds, median +([\d.]+) ms \(drafting +([\d.]+), target +([\d.]+), "
                     rf"rest +(-?[\d.]+)\); profile +([\d.]+) ms; ratio ([\d.]+)$", line)
        assert m, line
        rounds, ms, draft, target, rest, cell, ratio = (float(x) for x in m.groups())
        assert rounds >= 1 and 0 < draft < ms and 0 < target < ms and cell > 0
        assert abs(draft + target + rest - ms) < 0.2 and abs(ms / cell - ratio) < 0.01
