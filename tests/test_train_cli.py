"""End to end on the bundled target: regenerate answers, train each drafter kind briefly, load it, decode losslessly."""
import json

import pytest

import dspark
from dspark.cli import main
from dspark.decoding import decode
from dspark.drafters import NoDrafter


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    d = tmp_path_factory.mktemp("regen")
    prompts = d / "prompts.jsonl"
    rows = [{"turns": ["Write a Python function that adds two numbers."]},
            {"conversations": [{"role": "user", "content": "What is a dictionary in Python?"}]},
            {"turns": ["Tom has 3 bags of 12 apples. How many apples does he have?"]}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = d / "regen.jsonl"
    assert main(["regenerate", str(prompts), "--out", str(out), "--max-new-tokens", "40", "--drafter", "ngram",
                 "--dtype", "float32"]) == 0
    data = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(data) == 3 and all(len(r["answer_ids"]) > 0 for r in data)
    meta = json.loads((d / "regen.jsonl.meta.json").read_text())
    assert meta["sampling"]["temperature"] == 0.7 and meta["sampling"]["top_k"] == 20
    return out


@pytest.mark.parametrize("kind,extra", [("dspark", []), ("eagle3", []),
                                        ("dspark", ["--markov-head", "gated", "--markov-rank", "16"])])
def test_train_cli_produces_a_loadable_lossless_drafter(regenerated, tmp_path, kind, extra, bundled_target):
    out = tmp_path / kind
    assert main(["train", kind, "--data", str(regenerated), "--out", str(out), "--steps", "2", "--batch", "2",
                 "--num-anchors", "8", "--ckpt-every", "1", *extra]) == 0
    assert (out / "model.safetensors").exists() and (out / "README.md").exists()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and len(log[-1]["accept_rate"]) == 7
    drafter = dspark.load_drafter(str(out), bundled_target)
    if kind == "dspark" and not extra:
        assert drafter.cfg.markov_rank == 256  # the CLI default, as bundled
        assert drafter.cfg.markov_head_type == "vanilla"
    if extra:
        assert drafter.cfg.markov_head_type == "gated" and drafter.model.markov_head.gate_proj is not None
    ids = [bundled_target.tokenizer("def add(a, b):", add_special_tokens=False)["input_ids"]]
    ref = decode(bundled_target, NoDrafter(), ids, max_new_tokens=24)
    got = decode(bundled_target, drafter, ids, max_new_tokens=24)
    assert got[0].token_ids == ref[0].token_ids


def test_markov_head_choice_is_checked(bundled_target):
    from dspark.training.recipes import build_drafter

    with pytest.raises(ValueError, match="dspark kind only"):
        build_drafter("dflash", bundled_target, markov_head="gated")
    with pytest.raises(ValueError, match="'vanilla' or 'gated'"):
        build_drafter("dspark", bundled_target, markov_head="rnn")


def test_feature_cache_from_the_cli_trains_as_on_the_fly_and_is_reused(regenerated, tmp_path):
    def run(kind, out, *extra):
        assert main(["train", kind, "--data", str(regenerated), "--out", str(tmp_path / out), "--steps", "2",
                     "--batch", "2", "--num-anchors", "8", "--markov-rank", "16", *extra]) == 0
        return [json.loads(line) for line in (tmp_path / out / "train_log.jsonl").read_text().splitlines()]

    cache = tmp_path / "cache"
    assert main(["cache-features", "--data", str(regenerated), "--out", str(cache)]) == 0
    stamps = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert "index.json" in stamps and "shard-00000.safetensors" in stamps
    plain = run("dspark", "plain")
    cached = run("dspark", "cached", "--feature-cache", str(cache), "--tensorboard")
    assert [r["loss"] for r in cached] == [r["loss"] for r in plain]
    assert list((tmp_path / "cached" / "tensorboard").glob("events.out.tfevents.*"))
    assert f"read from the feature cache {cache}" in (tmp_path / "cached" / "README.md").read_text()
    assert "computed on the fly" in (tmp_path / "plain" / "README.md").read_text()
    run("eagle3", "eagle3", "--feature-cache", str(cache))  # the same layers: the cache is reused as it is
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stamps
    assert main(["train", "dspark", "--data", str(regenerated), "--out", str(tmp_path / "x"), "--steps", "1",
                 "--feature-cache", str(cache), "--no-bf16"]) == 2  # a float32 run does not fit a bf16 cache
