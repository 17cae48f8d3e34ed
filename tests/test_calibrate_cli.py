"""`dspark calibrate` fits a survival map that `load_drafter` picks up; schedulers are selectable from the CLI
and the Python API and keep greedy output identical to target-only decoding."""
import json
import re
import subprocess
import sys

import pytest

import dspark
from dspark.calibration.maps import LogisticMap
from dspark.cli import main
from dspark.identity import drafter_id, target_id
from dspark.scheduling import uniform_cost_model


@pytest.fixture(scope="module")
def ngram_calibration(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "ngram.json"
    code = main(["calibrate", "ngram", "--temperatures", "0", "1", "--domains", "code", "--fit-prompts", "3",
                 "--eval-prompts", "3", "--fit-offset", "3", "--max-new-tokens", "24", "--dtype", "float32",
                 "--out", str(out)])
    assert code == 0
    return out


def test_calibrate_writes_a_map_per_temperature_that_load_drafter_uses(ngram_calibration, bundled_target):
    data = json.loads(ngram_calibration.read_text())
    assert set(data["maps"]) == {"0.0", "1.0"}
    report = data["maps"]["1.0"]["metrics"]
    assert report["fit_rounds"] > 0 and report["eval_rounds"] > 0
    assert report["after"]["headline_ece"]["code"] is not None
    drafter = dspark.load_drafter("ngram", bundled_target, calibration=ngram_calibration)
    assert isinstance(drafter.calibration.map_for(1.0).base, LogisticMap)  # binned on top by default
    assert drafter.calibration.drafter == drafter_id(drafter)
    assert drafter.calibration.target == target_id(bundled_target)


def test_calibration_of_another_drafter_or_target_is_refused(ngram_calibration, bundled_target, tmp_path):
    with pytest.raises(ValueError, match=r"for drafter 'ngram-.*'dspark-.*field 'drafter'"):
        dspark.load_drafter("dspark", bundled_target, calibration=ngram_calibration)
    data = json.loads(ngram_calibration.read_text())
    data["target"] = "qwen3-000000000000"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"target 'qwen3-000000000000'.*field 'target'"):
        dspark.load_drafter("ngram", bundled_target, calibration=other)
    assert main(["calibrate", "ngram", "--fit-prompts", "30", "--eval-prompts", "40", "--fit-offset", "20",
                 "--out", str(tmp_path / "x.json"), "--dtype", "float32"]) == 2  # overlapping prompt ranges


def test_schedulers_keep_greedy_output_identical(bundled_target):
    drafter = dspark.load_drafter("dspark", bundled_target)
    prompts = ["def add(a, b):", "Why is the sky blue?"]
    ref = [r.token_ids for r in dspark.generate(bundled_target, dspark.load_drafter("none", bundled_target),
                                                 prompts, max_new_tokens=24)]
    cost = uniform_cost_model(gamma=7, batches=(1, 2), layout="padded")
    for name in ("fixed:3", "threshold:0.6", "batch-table", "dspark", "dspark-async", "none"):
        out = dspark.generate(bundled_target, drafter, prompts, max_new_tokens=24, scheduler=name, cost_model=cost)
        assert [r.token_ids for r in out] == ref, name
        if name == "none":
            assert all(s.draft_len == 0 for r in out for s in r.rounds)
        if name == "fixed:3":
            assert max(s.draft_len for r in out for s in r.rounds) == 3


def test_generate_cli_scheduler_and_bad_names():
    def run(*extra):
        return subprocess.run([sys.executable, "-m", "dspark.cli", "generate", "def is_even(n):", "--max-new-tokens",
                               "16", "--dtype", "float32", *extra], capture_output=True, text=True)

    ok = run("--drafter", "ngram", "--scheduler", "threshold:0.3")
    assert ok.returncode == 0 and "scheduler=threshold:0.3" in ok.stdout
    assert re.search(r"tau=([\d.]+)", ok.stdout)
    bad = run("--drafter", "ngram", "--scheduler", "threshold:2")
    assert bad.returncode == 2 and "θ in (0, 1], got 2.0" in bad.stderr


def test_an_explicit_profile_of_another_setup_is_refused_not_overwritten(bundled_target, tmp_path):
    from dspark.api import step_cost_model
    from dspark.profiling import ProfileMismatch

    from pathlib import Path

    src = json.loads((Path(__file__).parents[1] / "benchmarks/results/scheduling/profile_cpu.json").read_text())
    src["fingerprint"]["threads"] = 999
    path = tmp_path / "other.json"
    path.write_text(json.dumps(src))
    before = path.read_text()
    with pytest.raises(ProfileMismatch, match="threads"):
        step_cost_model(bundled_target, dspark.load_drafter("dspark", bundled_target), 1, path)
    assert path.read_text() == before


def test_calibrate_from_prompt_files_splits_each_domain_and_fits_per_domain_maps(tmp_path, capsys):
    rows = [{"domain": "code", "turns": [f"def f{i}(x):\n    return x + {i}", "answer"]} for i in range(4)]
    rows += [{"domain": "math", "turns": [f"What is {i} + {i}?"]} for i in range(4)]
    rows += [{"domain": "math", "turns": ["What is 0 + 0?"]}, {"domain": "prose", "turns": ["unused"]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out, records = tmp_path / "cal.json", tmp_path / "records"
    assert main(["calibrate", "ngram", "--temperatures", "1", "--domains", "code", "math", "--prompts", str(path),
                 "--max-new-tokens", "24", "--dtype", "float32", "--out", str(out),
                 "--records-dir", str(records)]) == 0
    data = json.loads(out.read_text())
    assert set(data["workloads"]) == {"code", "math"} and set(data["workloads"]["math"]) == {"1.0"}
    assert "after, per workload" in capsys.readouterr().out
    from dspark.calibration.records import RoundRecords

    fit = RoundRecords.load(next(records.glob("*_T1_fit.safetensors")))
    held = RoundRecords.load(next(records.glob("*_T1_eval.safetensors")))
    assert set(fit.domains()) == set(held.domains()) == {"code", "math"}
    assert data["maps"]["1.0"]["metrics"]["after_workload"]["headline_ece"]["math"] is not None


@pytest.mark.parametrize("content, args, pattern", [
    ('{"domain": "code"}\n', [], r"line 1: expected a JSON object with \"domain\" and a non-empty \"turns\""),
    ('{"domain": "code", "turns": ["x"]}\n', ["--domains", "code", "math"], r"no prompts of domain\(s\) \['math'\]"),
    ('{"domain": "code", "turns": ["x"]}\n', ["--fit-prompts", "3"], "give --eval-prompts together with"),
])
def test_bad_prompt_files_fail_before_loading_models(tmp_path, capsys, content, args, pattern):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    assert main(["calibrate", "ngram", "--domains", "code", "--prompts", str(path), *args,
                 "--out", str(tmp_path / "x.json")]) == 2
    assert re.search(pattern, capsys.readouterr().err)
    assert not (tmp_path / "x.json").exists()
