"""Acceptance statistics and the side-by-side benchmark."""
import json

import pytest

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
    for name in ("ngram", "draft-model"):  # the target-only row is the reference: check the others against it
        r = rows[name]
        assert r["identical_to_target_only"] == 1.0  # float32: lossless and numerically identical
        assert r["speedup"] == pytest.approx(r["tok_per_s"] / rows["none"]["tok_per_s"])
    dm = rows["draft-model"]  # its drafts are accepted (n-gram finds no match in 12 tokens of 2 prompts)
    assert dm["tau"] > 1.0 and dm["rounds"] < rows["none"]["rounds"]
    for r in rows.values():
        assert 0 < r["tokens"] <= sum((i + 1) * n for i, n in enumerate(r["histogram"]))
        assert sum(r["prompt_tokens"]) == r["tokens"] and sum(r["prompt_rounds"]) == r["rounds"]
        assert r["tau_se"] >= 0
    assert rows["none"]["tau_se"] == 0.0 and rows["draft-model"]["tau_se"] > 0
    macro = {m["drafter"]: m for m in res["macro"]}
    assert macro["ngram"]["tau_se"] == rows["ngram"]["tau_se"]  # one domain: the macro error is the domain's
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_tau.py"
    table = subprocess.run([sys.executable, str(script), str(out), "--reference", "draft-model", "--draws", "50"],
                           check=True, capture_output=True, text=True).stdout
    ratio = rows["ngram"]["tau"] / rows["draft-model"]["tau"] - 1
    assert f"| draft-model | {rows['draft-model']['tau']:.2f} |" in table and "| +0.0% | +0.0% .. +0.0% |" in table
    assert f"| ngram | {rows['ngram']['tau']:.2f} | {rows['ngram']['tau_se']:.2f} | {ratio:+.1%} |" in table
    assert plot.stat().st_size > 1000


def test_report_scripts_read_bench_json_and_training_logs(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bench = {"macro": [{"temperature": 0.0, "drafter": "dspark", "tau": 4.5, "tau_se": 0.123, "speedup": 2.9}],
             "runs": [{"temperature": 1.0, "domain": "code", "drafter": "dspark", "tau": 2.5, "speedup": 1.6,
                       "identical_to_target_only": None, "conditional_acceptance": [0.641, 0.6]}]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "tables.py"), str(tmp_path / "bench.json")],
                         check=True, capture_output=True, text=True).stdout
    assert "| 0.0 | dspark | 4.50 | 0.12 | 2.90x |" in out
    assert "| code | 1 | dspark | 2.50 | - | 1.60x | n/a | [0.64, 0.6] |" in out
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "accept_rate": [s / 10, s / 25]}) + "\n" for s in range(1, 5)))
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "train_curves.py"), str(log), "--window", "2",
                          "--every", "2"], check=True, capture_output=True, text=True).stdout
    assert "4 steps" in out and "last 2 steps: 0.35 0.14" in out and "steps 1-2: 0.15 0.06" in out


def _simulated_prompts(rng, n, accept):
    """Per-prompt (tokens, rounds) of n answers whose rounds accept Binomial(7, accept) drafts."""
    tokens, rounds = [], []
    for _ in range(n):
        a = min(0.95, max(0.05, accept + rng.gauss(0, 0.1)))  # prompts differ in difficulty
        r = rng.randint(15, 40)
        tokens.append(sum(1 + sum(rng.random() < a for _ in range(7)) for _ in range(r)))
        rounds.append(r)
    return tokens, rounds


def test_tau_standard_error_matches_the_spread_of_repeated_benchmarks():
    import random
    import statistics

    from dspark.evaluation.metrics import tau_standard_error

    assert tau_standard_error([30, 60], [10, 20]) == 0.0  # every prompt at the same τ
    rng = random.Random(0)
    taus, ses = [], []
    for _ in range(300):
        t, r = _simulated_prompts(rng, 25, 0.6)
        taus.append(sum(t) / sum(r))
        ses.append(tau_standard_error(t, r))
    spread = statistics.stdev(taus)
    assert 0.85 * spread < statistics.mean(ses) < 1.15 * spread


def test_paired_tau_ratio_interval_covers_the_true_ratio():
    import random


    from dspark.evaluation.metrics import paired_tau_ratio

    same = {"code": ([30, 60, 45], [10, 20, 9]), "prose": ([20, 22], [10, 11])}
    assert paired_tau_ratio(same, same, draws=50) == (1.0, 1.0, 1.0)
    doubled = {d: ([2 * x for x in t], r) for d, (t, r) in same.items()}
    assert paired_tau_ratio(doubled, same, draws=50) == pytest.approx((2.0, 2.0, 2.0))
    with pytest.raises(ValueError, match="different domains"):
        paired_tau_ratio({"code": same["code"]}, same)
    with pytest.raises(ValueError, match="same prompts"):
        paired_tau_ratio({"code": ([1], [1]), "prose": same["prose"]}, same)
    # Two drafters whose true τ differ: 1 + 7·0.7 vs 1 + 7·0.6, ratio 5.9 / 5.2 in every domain.
    rng = random.Random(1)
    covered = 0
    trials = 60
    for _ in range(trials):
        a = {d: _simulated_prompts(rng, 20, 0.7) for d in ("code", "prose")}
        b = {d: _simulated_prompts(rng, 20, 0.6) for d in ("code", "prose")}
        _, lo, hi = paired_tau_ratio(a, b, draws=300, seed=rng.randrange(10**6))
        covered += lo <= 5.9 / 5.2 <= hi
    assert covered >= 0.85 * trials


def test_mixed_eval_prompts_take_the_domains_in_turn():
    from dspark.evaluation.bench import load_eval_prompts, mixed_eval_prompts

    per = {d: load_eval_prompts(d, 5) for d in ("code", "prose", "math")}
    mixed = mixed_eval_prompts(5)
    assert mixed[:3] == [per["code"][0], per["prose"][0], per["math"][0]]
    assert sorted(mixed) == sorted(p for ps in per.values() for p in ps)
    for start in range(0, 13):  # any 3 consecutive prompts: one of each domain
        window = mixed[start:start + 3]
        assert sum(p in per["code"] for p in window) == 1
