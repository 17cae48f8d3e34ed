"""Step-cost profiling: cells measured through decode, fingerprints, save / load, reuse and re-profiling."""
from __future__ import annotations

import json

import numpy as np

import pytest
import torch

from dspark import profiling
from dspark.cost_fit import fit_row
from dspark.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from dspark.profiling import (
    FINGERPRINT_FIELDS,
    ProfileMismatch,
    StepProfile,
    default_profile_path,
    fingerprint_for,
    load_or_profile,
    load_profile,
    plot_profile,
    profile_steps,
)
from dspark.sampling import BatchSampling, SamplingParams
from dspark.scheduling import CostModel
from dspark.target import CausalLM
from tests.conftest import tiny_qwen3

FAST = {"context_len": 24, "warmup": 1, "reps": 2, "progress": False}


@pytest.fixture(scope="module")
def draft_lm() -> CausalLM:
    return CausalLM(tiny_qwen3(layers=1, hidden=32, seed=7))


@pytest.fixture(scope="module")
def profiles(qwen3_target, draft_lm) -> dict[str, StepProfile]:
    drafters = {"ngram": NgramDrafter(gamma=3), "draft-model": DraftModelDrafter(draft_lm, gamma=2)}
    return {name: profile_steps(qwen3_target, d, batches=(1, 2), drafter_name=name, **FAST)
            for name, d in drafters.items()}


@pytest.mark.parametrize("name,gamma", [("ngram", 3), ("draft-model", 2)])
def test_every_cell_is_measured_on_the_padded_grid(profiles, name, gamma):
    p = profiles[name]
    assert sorted(p.cost.plain) == [1, 2] and sorted(p.cost.drafted) == [1, 2]
    for b in (1, 2):
        assert [n for n, _ in p.cost.drafted[b]] == [b * (1 + k) for k in range(gamma + 1)]
        assert all(s > 0 for _, s in p.cost.drafted[b]) and p.cost.plain[b] > 0
        assert len(p.meta["plain_times"][str(b)]) == 2
        assert all(len(t) == 2 for t in p.meta["drafted_times"][str(b)].values())
        row, smoothed = fit_row({int(n): t for n, t in p.meta["drafted_times"][str(b)].items()})
        assert p.cost.drafted[b] == row and (b in p.meta["smoothed_rows"]) == smoothed  # a row from its repeats
    assert p.meta["gamma"] == gamma and p.meta["prompt_source"] == "random"
    # the per-slot drafting cost: drafting calls at the full width (every ℓ) against those drafting one slot
    assert p.cost.width == gamma and sorted(p.cost.draft_slot) == [1, 2]
    for b in (1, 2):
        calls = p.meta["draft_call_times"][str(b)]
        assert len(calls["narrow"]) == 2 and len(calls["full"]) == 2 * (gamma + 1)
        slope = (np.median(calls["full"]) - np.median(calls["narrow"])) / (gamma - 1)
        assert p.cost.draft_slot[b] == pytest.approx(max(0.0, slope))
    assert set(FINGERPRINT_FIELDS) <= set(p.fingerprint)
    assert p.fingerprint["drafter"]["name"] == name and p.fingerprint["context_len"] == 24
    assert p.fingerprint["threads"] == torch.get_num_threads() and p.fingerprint["layout"] == "padded"


def test_target_only_profile(qwen3_target):
    p = profile_steps(qwen3_target, NoDrafter(), batches=(1,), **FAST)
    assert p.fingerprint["drafter"] == {"name": "none", "sha": "none"}
    assert p.cost.drafted[1] == [(1, p.cost.plain[1])]


def test_a_profile_without_per_slot_costs_is_reprofiled(qwen3_target, tmp_path, capsys):
    """A profile saved by an older dspark (no draft_slot, no width) still loads, but `load_or_profile`
    measures it again: an adaptive policy prices its drafted width from it."""
    drafter, path = NgramDrafter(gamma=2), tmp_path / "old.json"
    load_or_profile(qwen3_target, drafter, "ngram", (1,), path=path, **FAST)
    data = json.loads(path.read_text())
    for key in ("draft_slot", "width"):
        data["cost"].pop(key)
    path.write_text(json.dumps(data))
    assert load_profile(path).cost.width is None  # readable
    kept = load_or_profile(qwen3_target, drafter, "ngram", (1,), path=path, reprofile=False, **FAST)
    assert kept.width is None  # a file given explicitly is used as it is
    cost = load_or_profile(qwen3_target, drafter, "ngram", (1,), path=path, **FAST)
    assert "per-slot cost" in capsys.readouterr().err
    assert cost.width == 2 and load_profile(path).cost.draft_slot.keys() == {1}


def test_short_ngram_blocks_are_padded_to_gamma():
    runner = profiling._FullBlock(NgramDrafter(gamma=4), 4)
    sampling = BatchSampling.from_params([SamplingParams()] * 2, "cpu")
    block = runner.propose([[5, 6, 7, 8], [1, 2, 1]], sampling, [None, None])  # no match; a 1-token match
    assert block.lengths.tolist() == [4, 4]
    assert block.tokens[1, 0].item() == 2 and block.tokens[0].tolist() == [8, 8, 8, 8]


def test_save_load_round_trip(profiles, tmp_path):
    p = profiles["ngram"]
    path = p.save(tmp_path / "sub" / "profile.json")
    assert [f.name for f in path.parent.iterdir()] == ["profile.json"]  # no temp file left behind
    data = json.loads(path.read_text())
    assert data["format"] == "dspark-step-profile" and data["version"] == 1
    back = load_profile(path, expect=p.fingerprint)
    assert back.cost.to_dict() == p.cost.to_dict()
    assert back.fingerprint == p.fingerprint and back.meta == json.loads(json.dumps(p.meta))
    assert back.cost.cost(2, 6) == p.cost.cost(2, 6)


def test_changed_setup_is_refused_naming_the_field(profiles, qwen3_target, draft_lm, tmp_path):
    p = profiles["ngram"]
    path = p.save(tmp_path / "p.json")
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        expect = fingerprint_for(qwen3_target, NgramDrafter(gamma=3), "ngram", 24)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ProfileMismatch) as err:
        load_profile(path, expect)
    assert list(err.value.differences) == ["threads"]
    assert "threads" in str(err.value) and str(threads) in str(err.value) and str(expect["threads"]) in str(err.value)
    assert str(path) in str(err.value)

    with pytest.raises(ProfileMismatch, match=r"dtype: file has 'float32', this run has 'bfloat16'"):
        load_profile(path, {**p.fingerprint, "dtype": "bfloat16"})

    other = fingerprint_for(qwen3_target, DraftModelDrafter(draft_lm, gamma=2), "draft-model", 24)
    with pytest.raises(ProfileMismatch) as err:
        load_profile(path, other)
    assert "drafter.name" in err.value.differences and "drafter.sha" in err.value.differences
    assert "'ngram'" in str(err.value) and "'draft-model'" in str(err.value)
    # the same drafter class with another block size is another drafter
    assert fingerprint_for(qwen3_target, NgramDrafter(gamma=2), "ngram", 24)["drafter"] != p.fingerprint["drafter"]
    assert fingerprint_for(qwen3_target, NgramDrafter(gamma=3), "ngram", 24) == p.fingerprint


def test_bad_files_fail_naming_file_and_field(profiles, tmp_path):
    good = profiles["ngram"].to_dict()
    missing = tmp_path / "absent.json"
    with pytest.raises(ValueError, match="absent.json"):
        load_profile(missing)

    truncated = tmp_path / "truncated.json"
    text = json.dumps(good)
    truncated.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"truncated\.json.*truncated or malformed"):
        load_profile(truncated)

    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\x00\xffnot json")
    with pytest.raises(ValueError, match="garbage.json"):
        load_profile(garbage)

    def broken(name: str, edit) -> str:
        data = json.loads(text)
        edit(data)
        path = tmp_path / name
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError) as err:
            load_profile(path)
        assert name in str(err.value)
        return str(err.value)

    msg = broken("cell.json", lambda d: d["cost"]["drafted"]["2"].pop(1))
    assert "cost.drafted.2" in msg and "N=4" in msg
    assert "cost.plain" in broken("plain.json", lambda d: d["cost"]["plain"].pop("2"))
    assert "'plain'" in broken("noplain.json", lambda d: d["cost"].pop("plain"))
    assert "fingerprint.threads" in broken("fp.json", lambda d: d["fingerprint"].pop("threads"))
    assert "meta.gamma" in broken("gamma.json", lambda d: d["meta"].pop("gamma"))
    assert "'format'" in broken("format.json", lambda d: d.update(format="other"))
    assert "seconds" in broken("neg.json", lambda d: d["cost"]["drafted"]["1"][0].__setitem__(1, -1.0))


def test_load_or_profile_reuses_matching_and_reprofiles_mismatch(qwen3_target, tmp_path, monkeypatch, capsys):
    calls: list[list[int]] = []
    real = profiling.profile_steps

    def counting(target, drafter, batches, **kw):
        calls.append(list(batches))
        return real(target, drafter, batches, **kw)

    monkeypatch.setattr(profiling, "profile_steps", counting)
    drafter = NgramDrafter(gamma=2)
    path = tmp_path / "p.json"
    cost = load_or_profile(qwen3_target, drafter, "ngram", (1,), path=path, **FAST)
    assert calls == [[1]] and path.exists()
    stamp = path.stat().st_mtime_ns

    again = load_or_profile(qwen3_target, drafter, "ngram", (1,), path=path, **FAST)
    assert calls == [[1]] and path.stat().st_mtime_ns == stamp  # reused, file untouched
    assert again.to_dict() == cost.to_dict()

    load_or_profile(qwen3_target, drafter, "ngram", (1, 2), path=path, **FAST)  # only the missing B
    assert calls == [[1], [2]]
    assert sorted(load_profile(path).cost.drafted) == [1, 2]

    data = json.loads(path.read_text())
    data["fingerprint"]["torch"] = "0.0-other"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileMismatch, match="torch: file has '0.0-other'"):
        load_or_profile(qwen3_target, drafter, "ngram", (1,), path=path, reprofile=False, **FAST)
    assert calls == [[1], [2]]
    capsys.readouterr()
    load_or_profile(qwen3_target, drafter, "ngram", (1,), path=path, **FAST)
    assert calls == [[1], [2], [1]]
    assert "torch: file has '0.0-other'" in capsys.readouterr().err
    assert load_profile(path, fingerprint_for(qwen3_target, drafter, "ngram", 24)).fingerprint["torch"] == torch.__version__

    path.write_text("{")
    with pytest.raises(ValueError, match="truncated or malformed"):
        load_or_profile(qwen3_target, drafter, "ngram", (1,), path=path, reprofile=False, **FAST)
    load_or_profile(qwen3_target, drafter, "ngram", (1,), path=path, **FAST)
    assert calls == [[1], [2], [1], [1]]


def test_default_profile_path(profiles, monkeypatch, tmp_path):
    fp = profiles["ngram"].fingerprint
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    path = default_profile_path(fp)
    assert path.parent == tmp_path / "profiles" and path.suffix == ".json"
    assert default_profile_path(dict(fp)) == path
    assert default_profile_path({**fp, "threads": fp["threads"] + 1}) != path
    monkeypatch.delenv("DSPARK_CACHE")
    assert ".cache/dspark/profiles" in default_profile_path(fp).as_posix()


def test_plot_writes_png(profiles, tmp_path):
    out = plot_profile(profiles["draft-model"], tmp_path / "plots" / "profile.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_attached_calibration_does_not_change_the_fingerprint(qwen3_target):
    from dspark.calibration.maps import Calibration, ConstantMap
    from dspark.drafters.ngram import NgramDrafter
    from dspark.profiling import fingerprint_for

    plain = NgramDrafter(gamma=3)
    plain.calibration = None
    calibrated = NgramDrafter(gamma=3)
    calibrated.calibration = Calibration({0.0: ConstantMap([0.5] * 3)})
    assert fingerprint_for(qwen3_target, plain, "ngram") == fingerprint_for(qwen3_target, calibrated, "ngram")
    assert fingerprint_for(qwen3_target, NgramDrafter(gamma=2), "ngram") != fingerprint_for(qwen3_target, plain, "ngram")


def test_an_engine_that_ran_does_not_change_the_drafters_fingerprint(qwen3_target):
    """The engine switches the drafter's peak reporting per run (`report_peaks`): a runtime flag, not the setup,
    so a profile measured before an engine ran still matches after (a second engine in one process found it
    mismatched)."""
    from dspark.drafters.ngram import NgramDrafter
    from dspark.engine import Engine, EngineConfig
    from dspark.profiling import fingerprint_for

    drafter = NgramDrafter(gamma=3)
    before = fingerprint_for(qwen3_target, drafter, "ngram")
    Engine(qwen3_target, drafter, "fixed", config=EngineConfig(record_signals=True))
    assert "report_peaks" in vars(drafter) and fingerprint_for(qwen3_target, drafter, "ngram") == before


def test_plot_of_a_fitted_row_below_its_repeats(tmp_path):
    """A fitted row may pass below every repeat of a stalled cell: the plot draws the table as a line and the
    medians with their repeats' range, so no error bar is negative."""
    reps = {str(n): [0.010 + 0.001 * n + (0.02 if n == 3 else 0.0)] * 2 + [0.011 + 0.001 * n] for n in range(1, 9)}
    profile = StepProfile(CostModel({1: [(n, 0.010 + 0.001 * n) for n in range(1, 9)]}, {1: 0.01}), {},
                          {"drafted_times": {"1": reps}})
    assert profile.cost.drafted[1][2][1] < min(reps["3"])
    assert plot_profile(profile, tmp_path / "p.png").stat().st_size > 0
