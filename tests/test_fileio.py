"""Files on disk: every kind dspark reads back fails, when truncated or corrupt, with a FileReadError naming
the file and the problem; an atomic write that fails midway leaves the old file and no partial one; a
pickle is refused, never unpickled. (SIGKILLed training runs: tests/test_train_kill.py.)"""
from __future__ import annotations

import io
import json
import pickle
import re
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

import dspark
import dspark.atomic as atomic
from dspark.api import load_causal_lm
from dspark.atomic import FileReadError, save_safetensors_atomic, write_text_atomic
from dspark.calibration.maps import Calibration
from dspark.checkpoints import save_block_drafter
from dspark.cli import main
from dspark.drafters.block import DSparkModel
from dspark.evaluation.bench import load_results
from dspark.profiling import load_profile
from dspark.target import CausalLM
from dspark.training.block_objective import block_drafter_loss
from dspark.training.data import load_sequences
from dspark.training.feature_cache import FeatureCache, build_feature_cache
from dspark.training.trainer import load_train_state, save_train_state, train
from dspark.zoo import zoo_dir
from tests.conftest import tiny_qwen3
from tests.training_fixtures import tiny_block_config, tiny_setup

ROOT = Path(__file__).resolve().parent.parent
NO_OTHER_TRACEBACK = "the error must not chain the parser's own exception"


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return CausalLM(tiny_qwen3(layers=4))


def halve(path: Path) -> None:
    """Truncate `path` to half its bytes, as a write cut short would leave it."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def expect_error(load: Callable[[], object], *patterns: str) -> FileReadError:
    """`load()` raises a FileReadError matching every pattern and chaining no parser exception."""
    with pytest.raises(FileReadError) as info:
        load()
    for pattern in patterns:
        assert re.search(pattern, str(info.value)), f"{pattern!r} not in: {info.value}"
    assert info.value.__cause__ is None and (info.value.__context__ is None or info.value.__suppress_context__), \
        NO_OTHER_TRACEBACK
    return info.value


def drafter_folder(d: Path, target: CausalLM) -> Callable[[], object]:
    save_block_drafter(DSparkModel(tiny_block_config()), d, target)
    return lambda: dspark.load_drafter(str(d), target, calibration=None)


def hf_folder(d: Path, target: CausalLM) -> Callable[[], object]:
    tiny_qwen3(layers=1).save_pretrained(d)
    return lambda: load_causal_lm(d, "float32")


def train_state(d: Path, target: CausalLM) -> Callable[[], object]:
    model = DSparkModel(tiny_block_config())
    save_train_state(d, model, torch.optim.AdamW(model.parameters()), 3, {})
    return lambda: load_train_state(d, model, torch.optim.AdamW(model.parameters()))


def feature_cache(d: Path, target: CausalLM) -> Callable[[], object]:
    _, _, seqs, _ = tiny_setup()
    build_feature_cache(target.model, seqs, [0, 2], d, dtype=torch.float32, autocast=False, rows_per_shard=5)
    return lambda: FeatureCache(d).check(target.model, seqs, [0, 2], autocast_bf16=False)


def copied(src: Path, load: Callable[[Path], object]) -> Callable[[Path, CausalLM], Callable[[], object]]:
    """A builder that copies a published file into the folder and loads it with `load`."""
    def build(d: Path, target: CausalLM) -> Callable[[], object]:
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, d / src.name)
        return lambda: load(d / src.name)
    return build


def training_data(d: Path, target: CausalLM) -> Callable[[], object]:
    d.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt_ids": [1, 2, 3], "answer_ids": list(range(4, 40))} for _ in range(3)]
    (d / "regen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return lambda: load_sequences(d / "regen.jsonl")


JSON_BROKEN = r"not valid JSON \(truncated or malformed\)"
ST_BROKEN = r"not a readable safetensors file \(truncated or corrupt\)"
KINDS = {  # kind: (builder, file to cut in half, patterns the error must match)
    "drafter weights": (drafter_folder, "model.safetensors", [r"drafter weights .*model\.safetensors", ST_BROKEN]),
    "drafter config": (drafter_folder, "config.json", [r"drafter config .*config\.json", JSON_BROKEN]),
    "model weights": (hf_folder, "model.safetensors", [r"model weights .*model\.safetensors", ST_BROKEN]),
    "model config": (hf_folder, "config.json", [r"model config .*config\.json", JSON_BROKEN]),
    "train state": (train_state, "train_state.safetensors", [r"train state .*train_state\.safetensors", ST_BROKEN]),
    "feature cache shard": (feature_cache, "shard-00001.safetensors",
                            [r"feature cache shard .*shard-00001\.safetensors", ST_BROKEN]),
    "feature cache index": (feature_cache, "index.json", [r"feature cache index .*index\.json", JSON_BROKEN]),
    "calibration": (copied(zoo_dir() / "dspark" / "calibration.json", Calibration.load), "calibration.json",
                    [r"calibration file .*calibration\.json", JSON_BROKEN]),
    "cost profile": (copied(ROOT / "benchmarks/results/scheduling/profile_cpu.json", load_profile), "profile_cpu.json",
                     [r"step profile .*profile_cpu\.json", JSON_BROKEN]),
    "bench results": (copied(ROOT / "benchmarks/results/bench.json", load_results), "bench.json",
                      [r"bench results .*bench\.json", JSON_BROKEN]),
    "training data": (training_data, "regen.jsonl", [r"training data .*regen\.jsonl line 2", "truncated or malformed"]),
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_truncated_file_fails_naming_the_file_and_the_problem(kind, tmp_path, target):
    build, name, patterns = KINDS[kind]
    load = build(tmp_path / "d", target)
    load()  # intact, it loads
    halve(tmp_path / "d" / name)
    expect_error(load, *patterns)


def test_cli_names_a_truncated_drafter_file_instead_of_a_traceback(tmp_path, capsys):
    d = tmp_path / "dspark"
    d.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(zoo_dir() / "dspark" / name, d / name)
    halve(d / "model.safetensors")
    assert main(["generate", "Hi", "--drafter", str(d), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"drafter weights {d / 'model.safetensors'} is not a readable safetensors file" in err
    assert "Traceback" not in err
    (d / "config.json").write_text('{"architectures": ["Qwen3DSparkModel"], "block_size": ')
    assert main(["generate", "Hi", "--drafter", str(d), "--max-new-tokens", "2"]) == 2
    assert f"drafter config {d / 'config.json'} is not valid JSON" in capsys.readouterr().err


def test_training_log_drops_a_torn_last_row_and_refuses_a_malformed_one(tmp_path):
    target, model, seqs, cfg = tiny_setup()
    cfg.steps = 2
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')  # a run killed while writing row 2, before any state
    train(model, target, seqs, block_drafter_loss, cfg, tmp_path / "a", log_path=log)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
    log.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    expect_error(lambda: train(model, target, seqs, block_drafter_loss, cfg, tmp_path / "b", log_path=log),
                 r"training log .*log\.jsonl line 2 is not valid JSON")


def test_train_state_resumes_from_its_own_metadata_and_reads_the_older_json_layout(tmp_path):
    model = DSparkModel(tiny_block_config())
    opt = torch.optim.AdamW(model.parameters())
    save_train_state(tmp_path, model, opt, 6, {"seconds": 2.5})
    (tmp_path / "train_state.json").write_text(json.dumps({"step": 3, "opt_steps": {}}))  # a stale copy
    assert load_train_state(tmp_path, model, opt) == (6, 2.5)
    tensors = load_file(str(tmp_path / "train_state.safetensors"))  # the layout before the step moved in
    save_file(tensors, str(tmp_path / "train_state.safetensors"))
    (tmp_path / "train_state.json").write_text(json.dumps({"step": 4, "opt_steps": {}, "seconds": 1.0}))
    assert load_train_state(tmp_path, model, opt) == (4, 1.0)


def test_a_train_state_of_another_model_fails_naming_the_file(tmp_path):
    save_train_state(tmp_path, DSparkModel(tiny_block_config()), torch.optim.SGD([torch.zeros(1)], 0.1), 1, {})
    other = DSparkModel(tiny_block_config(hidden_size=32, intermediate_size=64, head_dim=8))
    expect_error(lambda: load_train_state(tmp_path, other, torch.optim.AdamW(other.parameters())),
                 r"train state .*train_state\.safetensors is malformed or does not fit this model")


def fail_halfway_text(path: Path, data: bytes) -> None:
    path.write_bytes(data[: len(data) // 2])
    raise OSError(28, "No space left on device")


def test_an_interrupted_atomic_write_leaves_the_old_file_and_no_partial_one(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    write_text_atomic(path, '{"old": true}')
    monkeypatch.setattr(atomic, "_write_file", fail_halfway_text)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(path, json.dumps({"new": list(range(1000))}))
    assert path.read_text() == '{"old": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.json"]


def test_an_interrupted_checkpoint_save_leaves_the_old_checkpoint_loading(tmp_path, monkeypatch, target):
    old, new = DSparkModel(tiny_block_config()), DSparkModel(tiny_block_config(markov_rank=4))
    save_block_drafter(old, tmp_path, target)
    real = atomic.save_file

    def fail_halfway(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        halve(Path(filename))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic, "save_file", fail_halfway)
    with pytest.raises(OSError, match="No space left"):
        save_block_drafter(new, tmp_path, target)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = dspark.load_drafter(str(tmp_path), target, calibration=None)
    assert loaded.cfg.markov_rank == 8  # the old config with the old weights, not the new config
    want = old.state_dict()
    for name, p in loaded.model.state_dict().items():
        assert torch.equal(p, want[name]), name
    save_safetensors_atomic(tmp_path / "x.safetensors", {"a": torch.ones(2)})  # the real writer works again
    assert torch.equal(load_file(str(tmp_path / "x.safetensors"))["a"], torch.ones(2))


class Payload:
    """Unpickling this creates the file `marker`: proof that a pickle was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def pickled(marker: Path, how: str) -> bytes:
    if how == "pickle":
        return pickle.dumps(Payload(marker))
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)  # torch.save's zip archive around the same pickle
    return buf.getvalue()


def test_the_payload_is_live(tmp_path):
    for how in ("pickle", "torch.save"):
        marker = tmp_path / f"control-{how}"
        data = pickled(marker, how)
        if how == "pickle":
            pickle.loads(data)
        else:
            torch.load(io.BytesIO(data), weights_only=False)
        assert marker.exists()  # unpickled, it runs: the refusals below are meaningful


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
@pytest.mark.parametrize("kind,name,patterns", [
    ("drafter", "model.safetensors", [r"drafter weights .*model\.safetensors is a pickle"]),
    ("drafter", "pytorch_model.bin", [r"has no model\.safetensors, only pytorch_model\.bin"]),
    ("drafter", "model.pt", [r"has no model\.safetensors, only model\.pt"]),
    ("model", "model.safetensors", [r"model weights .*model\.safetensors is a pickle"]),
    ("model", "pytorch_model.bin", [r"has no \.safetensors weights, only pytorch_model\.bin"]),
    ("train state", "train_state.safetensors", [r"train state .*train_state\.safetensors is a pickle"]),
])
def test_a_pickle_is_refused_never_unpickled(kind, name, patterns, how, tmp_path, target):
    d, marker = tmp_path / "d", tmp_path / "marker"
    build = {"drafter": drafter_folder, "model": hf_folder, "train state": train_state}[kind]
    load = build(d, target)
    for weights in d.glob("*.safetensors"):
        weights.unlink()
    (d / name).write_bytes(pickled(marker, how))
    err = expect_error(load, *patterns)
    assert "never unpickles" in str(err)
    assert not marker.exists()


def test_dspark_has_no_unpickling_call():
    for path in (ROOT / "dspark").rglob("*.py"):
        text = path.read_text()
        for pattern in (r"torch\.load\(", r"import (c?pickle|dill|joblib)", r"pickle\.loads?\(",
                        r"weights_only\s*=\s*False", r"allow_pickle\s*=\s*True"):
            assert not re.search(pattern, text), f"{path}: {pattern}"
