"""Acceptance statistics and the side-by-side benchmark."""
import json

from dspark.cli import main
from dspark.decoding import RoundStats
from dspark.evaluation.metrics import acceptance_stats


def test_acceptance_stats_conditional_and_cumulative():
    rounds = [RoundStats(4, 4), RoundStats(4, 0), RoundStats(4, 2), RoundStats(4, 1), RoundStats(2, 2)]
    tokens = sum(r.accepted + 1 for r in rounds)
    s = acceptance_stats(rounds, tokens)
    assert s.tau == tokens / 5
    assert s.histogram == [1, 1, 2, 0, 1]
    # position 1 offered 5 times, passed 4; position 2: passed by 3 of 5 offered, 3 of the 4 that reached it
    assert s.cumulative[:2] == [4 / 5, 3 / 5]
    assert s.conditional[:2] == [4 / 5, 3 / 4]
    # positions 3-4 offered only by the four 4-draft rounds
    assert s.cumulative[2] == 1 / 4 and s.conditional[2] == 1 / 2


def test_bench_runs_drafters_side_by_side(tmp_path):
    out = tmp_path / "bench.json"
    plot = tmp_path / "acc.png"
    assert main(["bench", "--drafters", "ngram", "draft-model", "--domains", "code", "--temperatures", "0",
                 "--num-prompts", "2", "--max-new-tokens", "12", "--json", str(out), "--plot", str(plot),
                 "--dtype", "float32"]) == 0
    res = json.loads(out.read_text())
    rows = {r["drafter"]: r for r in res["runs"]}
    assert set(rows) == {"none", "ngram", "draft-model"}
    assert rows["none"]["tau"] == 1.0 and rows["none"]["speedup"] == 1.0
    for r in rows.values():
        assert r["identical_to_target_only"] == 1.0  # float32: lossless and numerically identical
        assert 0 < r["tokens"] <= sum((i + 1) * n for i, n in enumerate(r["histogram"]))
    assert plot.stat().st_size > 1000


def test_report_scripts_read_bench_json_and_training_logs(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bench = {"macro": [{"temperature": 0.0, "drafter": "dspark", "tau": 4.5, "speedup": 2.9}],
             "runs": [{"temperature": 1.0, "domain": "code", "drafter": "dspark", "tau": 2.5, "speedup": 1.6,
                       "identical_to_target_only": None, "conditional_acceptance": [0.641, 0.6]}]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "tables.py"), str(tmp_path / "bench.json")],
                         check=True, capture_output=True, text=True).stdout
    assert "| 0.0 | dspark | 4.50 | 2.90x |" in out
    assert "| code | 1 | dspark | 2.50 | 1.60x | n/a | [0.64, 0.6] |" in out
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "accept_rate": [s / 10, s / 25]}) + "\n" for s in range(1, 5)))
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "train_curves.py"), str(log), "--window", "2",
                          "--every", "2"], check=True, capture_output=True, text=True).stdout
    assert "4 steps" in out and "last 2 steps: 0.35 0.14" in out and "steps 1-2: 0.15 0.06" in out
