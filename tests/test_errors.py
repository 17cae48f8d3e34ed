"""Bad input gets a clear error message, from the API and from the CLI."""
import json
import shutil

import pytest

import dspark
from dspark.cli import main
from dspark.decoding import decode
from dspark.drafters import NoDrafter
from dspark.zoo import zoo_dir


def test_unknown_drafter(bundled_target):
    with pytest.raises(ValueError, match="unknown drafter 'medusa'"):
        dspark.load_drafter("medusa", bundled_target)


def test_empty_prompt_and_bad_max_new_tokens(bundled_target):
    with pytest.raises(ValueError, match="prompt is empty"):
        dspark.generate(bundled_target, NoDrafter(), "")
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        decode(bundled_target, NoDrafter(), [[]])
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
            dspark.generate(bundled_target, NoDrafter(), "hi", max_new_tokens=bad)


def test_too_long_prompt(bundled_target):
    limit = bundled_target.model.config.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the target's context"):
        decode(bundled_target, NoDrafter(), [[5] * limit], max_new_tokens=4)


def test_draft_with_other_vocabulary(bundled_target, tmp_path):
    from tests.conftest import tiny_qwen3

    tiny_qwen3(vocab=500).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocab_size is 500 in the drafter but 8192 in the target"):
        dspark.load_drafter(str(tmp_path), bundled_target)


def test_draft_with_other_tokenizer(bundled_target, tmp_path):
    shutil.copytree(zoo_dir() / "draft-model", tmp_path / "d")
    path = tmp_path / "d" / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab)[100], sorted(vocab)[200]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="tokenizer differs"):
        dspark.load_drafter(str(tmp_path / "d"), bundled_target)


def test_cli_reports_errors_without_traceback(capsys):
    assert main(["generate", "hello", "--drafter", "nope", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "dspark generate: error: argument --drafter: unknown drafter 'nope'" in err and "Traceback" not in err
    assert main(["generate", "", "--drafter", "none"]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    assert main(["generate", "hi", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err
