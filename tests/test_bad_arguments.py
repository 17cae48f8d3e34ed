"""Bad arguments to every user-facing entry point: one line (CLI) or a ValueError (Python API) that names the
argument and the accepted values; no traceback, no model loaded first, no silent substitute for a bad value."""
from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

import dspark
from dspark.arguments import check_int, check_real, resolve_device
from dspark.cli import main
from dspark.drafters.base import NoDrafter
from dspark.sampling import SamplingParams

# (argv, text the one error line holds: the argument and its accepted values)
CLI = [
    (["generate", "hi", "--max-new-tokens", "-5"], "argument --max-new-tokens: must be an integer >= 1, got -5"),
    (["generate", "hi", "--max-new-tokens", "abc"], "argument --max-new-tokens: must be an integer >= 1, got 'abc'"),
    (["generate", "hi", "--temperature", "-1"], "argument --temperature: must be a finite number >= 0, got -1.0"),
    (["generate", "hi", "--temperature", "nan"], "argument --temperature: must be a finite number >= 0, got nan"),
    (["generate", "hi", "--top-p", "2"], "argument --top-p: must be a finite number in (0, 1], got 2.0"),
    (["generate", "hi", "--top-p", "0"], "argument --top-p: must be a finite number in (0, 1], got 0.0"),
    (["generate", "hi", "--top-k", "-3"], "argument --top-k: must be an integer >= 0, got -3"),
    (["generate", "hi", "--gamma", "0"], "argument --gamma: must be an integer >= 1, got 0"),
    (["generate", "hi", "--bias-candidates", "0"], "argument --bias-candidates: must be an integer >= 1, got 0"),
    (["generate", "hi", "--drafter", "medusa"], "argument --drafter: unknown drafter 'medusa': choose one of none, "
                                                "ngram, draft-model, dflash, dspark, dspark-rnn, eagle3 or the folder"),
    (["generate", "hi", "--scheduler", "greedy"], "argument --scheduler: unknown scheduler 'greedy'; choose one of "
                                                  "none, fixed:K, threshold:θ"),
    (["generate", "hi", "--scheduler", "threshold:2"], "argument --scheduler: scheduler threshold:θ needs θ in (0, 1]"),
    (["generate", "hi", "--scheduler", "fixed:x"], "argument --scheduler: scheduler fixed:K needs an integer K"),
    (["generate", "hi", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8' (choose from 'float32', "
                                              "'bfloat16', 'float16')"),
    (["generate", "hi", "--device", "tpu"], "argument --device: the device must be a torch device such as cpu, cuda"),
    (["generate", "hi", "--device", "cuda:99"], "argument --device: the device 'cuda:99' is not available"),
    (["bench", "--num-prompts", "0"], "argument --num-prompts: must be an integer >= 1, got 0"),
    (["bench", "--temperatures", "0", "-1"], "argument --temperatures: must be a finite number >= 0, got -1.0"),
    (["bench", "--domains", "code", "poetry"], "argument --domains: unknown domain 'poetry': choose from code, math, "
                                               "prose"),
    (["bench", "--drafters", "none", "medusa"], "argument --drafters: unknown drafter 'medusa'"),
    (["bench", "--drafters", "none", "--schedulers", "nope"], "argument --schedulers: unknown scheduler 'nope'"),
    (["serve", "--port", "70000"], "argument --port: must be an integer in [0, 65535], got 70000"),
    (["serve", "--port", "-1"], "argument --port: must be an integer in [0, 65535], got -1"),
    (["serve", "--max-running", "0"], "argument --max-running: must be an integer >= 1, got 0"),
    (["serve", "--max-waiting", "-4"], "argument --max-waiting: must be an integer >= 1, got -4"),
    (["serve", "--prefill-chunk", "0"], "argument --prefill-chunk: must be an integer >= 1, got 0"),
    (["serve", "--kv-budget-tokens", "0"], "argument --kv-budget-tokens: must be an integer >= 1, got 0"),
    (["serve", "--shutdown-timeout", "-1"], "argument --shutdown-timeout: must be a finite number >= 0, got -1.0"),
    (["serve", "--drafter", "medusa"], "argument --drafter: unknown drafter 'medusa'"),
    (["serve", "--scheduler", "nope"], "argument --scheduler: unknown scheduler 'nope'"),
    (["serve", "--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
    (["profile", "--batches", "1", "0"], "argument --batches: must be an integer >= 1, got 0"),
    (["profile", "--context-len", "1"], "argument --context-len: must be an integer >= 2, got 1"),
    (["profile", "--warmup", "-1"], "argument --warmup: must be an integer >= 0, got -1"),
    (["profile", "--reps", "0"], "argument --reps: must be an integer >= 1, got 0"),
    (["calibrate", "medusa"], "argument drafter: unknown drafter 'medusa'"),
    (["calibrate", "ngram", "--fit-prompts", "0"], "argument --fit-prompts: must be an integer >= 1, got 0"),
    (["calibrate", "ngram", "--fit-offset", "-1"], "argument --fit-offset: must be an integer >= 0, got -1"),
    (["calibrate", "ngram", "--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got 0"),
    (["calibrate", "ngram", "--domains", "poetry"], "unknown domain 'poetry': choose from code, math, prose"),
    (["generate", "hi", "--workload", ""], "argument --workload: the label is empty"),
    (["generate", "hi", "--workload", "w" * 65], "argument --workload: labels are at most 64 characters, got 65"),
    (["calibrate", "ngram", "--temperature", "-0.5"], "argument --temperatures/--temperature: must be a finite "
                                                      "number >= 0, got -0.5"),
    (["train", "dspark", "--data", "/no/such.jsonl", "--out", "x"], "argument --data: no such file or folder: "
                                                                    "/no/such.jsonl"),
    (["train", "medusa", "--data", "x", "--out", "y"], "argument kind: invalid choice: 'medusa'"),
    (["train", "dspark", "--data", ".", "--out", "x", "--steps", "0"], "argument --steps: must be an integer >= 1"),
    (["train", "dspark", "--data", ".", "--out", "x", "--lr", "0"], "argument --lr: must be a finite number > 0, got 0.0"),
    (["train", "dspark", "--data", ".", "--out", "x", "--batch", "-8"], "argument --batch: must be an integer >= 1"),
    (["train", "dspark", "--data", ".", "--out", "x", "--block-size", "0"], "argument --block-size: must be an "
                                                                            "integer >= 1"),
    (["train", "dspark", "--data", ".", "--out", "x", "--device", "gpu"], "argument --device: the device must be a "
                                                                          "torch device"),
    (["regenerate", "/no/such.jsonl", "--out", "x"], "argument prompts: no such file or folder: /no/such.jsonl"),
    (["regenerate", ".", "--out", "x", "--top-p", "1.5"], "argument --top-p: must be a finite number in (0, 1]"),
    (["cache-features", "--data", ".", "--out", "x", "--max-len", "0"], "argument --max-len: must be an integer >= 1"),
]


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv, says", CLI, ids=[" ".join(a) for a, _ in CLI])
def test_cli_bad_argument_is_one_line_naming_it(argv, says, capsys):
    start = time.perf_counter()
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"dspark {argv[0]}: error: ") and says in line, line
    assert line.endswith(f"(see dspark {argv[0]} --help)")
    assert time.perf_counter() - start < 5  # refused before any model is loaded


def test_cli_help_still_exits_zero(capsys):
    assert main(["serve", "--help"]) == 0
    assert "--port" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["generate", "hi", "--drafter", "dspark", "--gamma", "99"], "gamma must be in [1, 7] for this drafter, got 99"),
    (["generate", "hi", "--drafter", "ngram", "--scheduler", "fixed:9"], "scheduler fixed:K needs K in [0, 4]"),
    (["generate", "hi", "--drafter", "ngram", "--calibration", "/no/such.json"], "calibration file /no/such.json"),
])
def test_cli_argument_checked_against_the_loaded_drafter(argv, says, capsys):
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("dspark: error: ") and says in line, line


def test_serve_step_log_that_cannot_be_written_fails_before_loading(tmp_path, capsys):
    start = time.perf_counter()
    assert main(["serve", "--step-log", str(tmp_path)]) == 2  # a folder, not a file
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"dspark: error: --step-log: cannot write {tmp_path}"), line
    assert time.perf_counter() - start < 5  # refused before any model is loaded


def test_the_console_command_exits_2_with_one_line():
    """The real `dspark` process: exit status 2, one line on stderr, nothing on stdout, well before a model loads."""
    for argv, says in [(["serve", "--port", "70000"], "argument --port: must be an integer in [0, 65535]"),
                       (["generate", "hi", "--temperature", "-1", "--top-p", "0.5"], "argument --temperature")]:
        proc = subprocess.run([sys.executable, "-m", "dspark.cli", *argv], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stdout == ""
        assert says in one_line(proc.stderr)


# ---------------------------------------------------------------------- the Python API
@pytest.mark.parametrize("kwargs, says", [
    (dict(max_new_tokens=-5), "max_new_tokens must be an integer >= 1, got -5"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1, got 2.5"),
    (dict(max_new_tokens=10**6), "max_new_tokens=1000000 that exceeds the target's context of 2048 tokens"),
    (dict(temperature=-1), "temperature must be a finite number >= 0, got -1"),
    (dict(temperature=math.nan), "temperature must be a finite number >= 0, got nan"),
    (dict(temperature=math.inf), "temperature must be a finite number >= 0, got inf"),
    (dict(temperature="0.5"), "temperature must be a finite number >= 0, got '0.5'"),
    (dict(top_p=2), r"top_p must be a finite number in (0, 1], got 2"),
    (dict(top_p=math.nan), r"top_p must be a finite number in (0, 1], got nan"),
    (dict(top_k=-1), "top_k must be an integer >= 0 (0 disables it), got -1"),
    (dict(top_k=2.5), "top_k must be an integer >= 0 (0 disables it), got 2.5"),
    (dict(seed="x"), "seed must be an integer, got 'x'"),
    (dict(seed=2**70), "seed must be an integer in [-9223372036854775808, 18446744073709551615] or None"),
    (dict(prompts=[]), "prompts must be a string or a non-empty list of strings, got []"),
    (dict(prompts=5), "prompts must be a string or a non-empty list of strings, got 5"),
    (dict(prompts=["ok", 7]), "prompts[1] must be a string, got 7"),
    (dict(prompts=""), "prompt is empty"),
    (dict(prompts="caf\ud800"), "prompt is not valid Unicode: a lone surrogate '\\ud800' at character 3"),
    (dict(scheduler="greedy"), "unknown scheduler 'greedy'; choose one of"),
    (dict(scheduler="fixed:9"), r"scheduler fixed:K needs K in [0, 4]"),
])
def test_generate_names_the_bad_argument(bundled_target, kwargs, says):
    kwargs = {"prompts": "hi", "max_new_tokens": 2, **kwargs}
    drafter = dspark.load_drafter("ngram", bundled_target)
    with pytest.raises(ValueError) as err:
        dspark.generate(bundled_target, drafter, kwargs.pop("prompts"), **kwargs)
    assert says in str(err.value)


@pytest.mark.parametrize("name, kwargs, says", [
    ("medusa", {}, "unknown drafter 'medusa': use one of none, ngram, draft-model"),
    (5, {}, "name_or_path must be a drafter name (none, ngram,"),
    ("ngram", dict(gamma=0), "gamma must be an integer >= 1, got 0"),  # was silently 4
    ("ngram", dict(gamma=-1), "gamma must be an integer >= 1, got -1"),
    ("draft-model", dict(gamma=0), "gamma must be an integer >= 1, got 0"),  # was silently 4
    ("eagle3", dict(gamma=0), "gamma must be an integer >= 1, got 0"),  # was silently the trained length
    ("dspark", dict(gamma=2.5), "gamma must be an integer >= 1, got 2.5"),
    ("dspark", dict(gamma=99), "gamma must be in [1, 7] for this drafter, got 99"),
    ("dspark", dict(bias_candidates=0), "bias_candidates must be an integer >= 1, got 0"),
    ("dspark", dict(calibration="/no/such.json"), "calibration file /no/such.json does not exist"),
])
def test_load_drafter_names_the_bad_argument(bundled_target, name, kwargs, says):
    with pytest.raises(ValueError) as err:
        dspark.load_drafter(name, bundled_target, **kwargs)
    assert says in str(err.value)


@pytest.mark.parametrize("kwargs, says", [
    (dict(dtype="float8"), "unknown dtype 'float8'; choose one of float32, bfloat16, float16"),
    (dict(device="tpu"), "device must be a torch device such as cpu, cuda, cuda:N or mps, got 'tpu'"),
    (dict(device="cuda:99"), "device 'cuda:99' is not available"),
])
def test_load_target_names_the_bad_argument(kwargs, says):
    with pytest.raises(ValueError) as err:
        dspark.load_target(**kwargs)
    assert says in str(err.value)


def test_sampling_params_and_checks():
    for kwargs, says in [(dict(temperature=math.nan), "temperature must be a finite number >= 0"),
                         (dict(top_k=True), "top_k must be an integer >= 0"),
                         (dict(top_p=0.0), "top_p must be a finite number in (0, 1]"),
                         (dict(seed=1.5), "seed must be an integer in")]:
        with pytest.raises(ValueError, match=None) as err:
            SamplingParams(**kwargs)
        assert says in str(err.value)
    assert SamplingParams(0.7, 20, 0.8, 3) == SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=3)
    assert check_int("n", 5, 1, 5) == 5 and check_real("x", 10**400 // 10**399, 0, 10) == 10.0
    with pytest.raises(ValueError, match=r"x must be a finite number in \[0, 2\], got 1000"):
        check_real("x", 10**400, 0, 2)  # an int too big for a float is out of range, not an OverflowError
    assert resolve_device("cpu").type == "cpu"


def test_a_good_call_still_works(bundled_target):
    (out,) = dspark.generate(bundled_target, NoDrafter(), "hi", max_new_tokens=2, temperature=0.5, top_k=5,
                             top_p=0.9, seed=1)
    assert 1 <= len(out.token_ids) <= 2
