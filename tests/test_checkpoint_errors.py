"""Error paths of checkpoint loading (dspark/checkpoints.py): every malformed or mismatched drafter folder fails
at load with a message naming the folder or file and what is wrong, never loads half a model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import dspark
from dspark.zoo import bundled_drafter_path


def copy_drafter(name: str, tmp_path: Path) -> Path:
    out = tmp_path / name
    shutil.copytree(bundled_drafter_path(name), out)
    (out / "calibration.json").unlink(missing_ok=True)  # the checkpoint's own errors, not the calibration's
    return out


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))


def load_error(folder: Path, target) -> str:
    with pytest.raises((ValueError, OSError)) as err:
        dspark.load_drafter(str(folder), target)
    return str(err.value)


def test_an_unknown_architecture_never_loads_half_a_model(bundled_target, tmp_path):
    folder = copy_drafter("dspark", tmp_path)
    edit_config(folder, architectures=["MedusaModel"], markov_rank=None)
    msg = load_error(folder, bundled_target)
    # not a block drafter nor EAGLE-3, so read as a draft model (an HF causal LM): whose weights do not fit
    assert "weights do not match its config.json" in msg and "MedusaModel" in msg and str(folder) in msg, msg


@pytest.mark.parametrize("field", ["target_layer_ids", "mask_token_id", "block_size"])
def test_a_missing_required_field_is_named(bundled_target, tmp_path, field):
    folder = copy_drafter("dspark", tmp_path)
    edit_config(folder, **{field: None})
    msg = load_error(folder, bundled_target)
    assert msg == f"drafter config {folder / 'config.json'}: required field {field!r} is missing", msg


def test_weights_that_do_not_match_the_config_name_the_keys(bundled_target, tmp_path):
    folder = copy_drafter("dspark", tmp_path)
    weights = load_file(folder / "model.safetensors")
    dropped = sorted(k for k in weights if "layers.0." in k)[0]
    del weights[dropped]
    weights["stray.weight"] = next(iter(weights.values())).clone()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    msg = load_error(folder, bundled_target)
    assert "does not match its config" in msg and dropped in msg and "stray.weight" in msg and str(folder) in msg


def test_a_folder_with_only_pickled_weights_is_refused(bundled_target, tmp_path):
    folder = copy_drafter("dspark", tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    msg = load_error(folder, bundled_target)
    assert "no model.safetensors" in msg and "pytorch_model.bin" in msg and str(folder) in msg, msg


def test_a_drafter_for_another_vocabulary_names_both_sizes(bundled_target, tmp_path):
    folder = copy_drafter("dspark", tmp_path)
    edit_config(folder, vocab_size=bundled_target.vocab_size * 2)
    msg = load_error(folder, bundled_target)
    assert "does not fit the target" in msg and str(bundled_target.vocab_size * 2) in msg, msg


def test_a_target_layer_beyond_the_target_is_named(bundled_target, tmp_path):
    folder = copy_drafter("dspark", tmp_path)
    edit_config(folder, target_layer_ids=[1, 99])
    msg = load_error(folder, bundled_target)
    assert "does not fit the target" in msg and "99" in msg, msg


def test_eagle3_with_more_than_one_layer_is_refused(bundled_target, tmp_path):
    folder = copy_drafter("eagle3", tmp_path)
    edit_config(folder, draft_num_hidden_layers=2)
    msg = load_error(folder, bundled_target)
    assert msg == f"drafter config {folder / 'config.json'}: EAGLE-3 drafters have one layer; config says 2", msg


def test_eagle3_without_target_layers_names_the_field(bundled_target, tmp_path):
    folder = copy_drafter("eagle3", tmp_path)
    edit_config(folder, target_layer_ids=None)
    msg = load_error(folder, bundled_target)
    assert msg == f"drafter config {folder / 'config.json'}: required field 'target_layer_ids' is missing", msg


def test_a_broken_config_names_the_file(bundled_target, tmp_path):
    folder = copy_drafter("eagle3", tmp_path)
    (folder / "config.json").write_text('{"architectures": ["Qwen3Eagle3Model"], ')
    msg = load_error(folder, bundled_target)
    assert str(folder / "config.json") in msg, msg
    (folder / "config.json").write_text("[1, 2]")
    msg = load_error(folder, bundled_target)
    assert "is not a JSON object" in msg and str(folder / "config.json") in msg, msg
