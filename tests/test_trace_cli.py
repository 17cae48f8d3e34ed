"""`dspark trace` records traces that `dspark simulate` replays from the command line."""
import json

import pytest

from dspark.cli import main
from dspark.evaluation.simulate import Trace


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    out = tmp_path_factory.mktemp("traces")
    assert main(["trace", "ngram", "--out", str(out), "--domains", "code", "math", "--prompts", "2",
                 "--max-new-tokens", "16", "--dtype", "float32"]) == 0
    return sorted(out.glob("*.json"))


def test_trace_then_simulate_on_a_gpu_curve(traces, tmp_path, capsys):
    assert [p.name for p in traces] == ["ngram_code_T1.json", "ngram_math_T1.json"]
    trace = Trace.load(traces[0])
    assert len(trace) == 2 and trace.gamma == 4 and sum(r.num_rounds for r in trace.requests) > 0
    rows_path = tmp_path / "rows.json"
    assert main(["simulate", *map(str, traces), "--gpu-curve", "benchmarks/results/scheduling/gpu_curve.json",
                 "--schedulers", "none", "fixed", "dspark", "--concurrency", "1", "8",
                 "--json", str(rows_path)]) == 0
    out = capsys.readouterr().out
    assert "concurrency" in out and "dspark" in out
    rows = json.loads(rows_path.read_text())
    assert {(r["scheduler"], r["concurrency"]) for r in rows} == {(s, c) for s in ("none", "fixed", "dspark")
                                                                 for c in (1, 8)}
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert all(r["speedup"] == 1.0 for r in rows if r["scheduler"] == "none")


def test_simulate_refuses_bad_input(traces, tmp_path, capsys):
    assert main(["simulate", str(traces[0])]) == 2  # no cost curve
    assert "one of the arguments --profile --gpu-curve is required" in capsys.readouterr().err
    other = json.loads(traces[0].read_text())
    other["gamma"] = 7
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps(other))
    code = main(["simulate", str(traces[0]), str(bad), "--gpu-curve", "benchmarks/results/scheduling/gpu_curve.json"])
    assert code == 2 and "different block widths" in capsys.readouterr().err
