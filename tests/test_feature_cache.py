"""Target features cached to safetensors shards: same training as on the fly, checked against misuse, resumable."""
import json

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from dspark.drafters.eagle3 import Eagle3Config, Eagle3Model
from dspark.training.block_objective import block_drafter_loss
from dspark.training.eagle3_objective import eagle3_loss
from dspark.training.feature_cache import FeatureCache, build_feature_cache, target_outputs
from dspark.training.trainer import train
from tests.conftest import tiny_qwen3
from tests.training_fixtures import tiny_setup


def _eagle3(seed: int = 1) -> Eagle3Model:
    torch.manual_seed(seed)
    return Eagle3Model(Eagle3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    intermediate_size=128, vocab_size=96, target_layer_ids=[0, 2], ttt_length=3))


@pytest.mark.parametrize("kind", ["block", "eagle3"])
@pytest.mark.parametrize("bf16", [False, True])
def test_cached_training_equals_on_the_fly_training(tmp_path, kind, bf16):
    target, block_model, seqs, cfg = tiny_setup()
    cfg.bf16 = bf16
    objective = block_drafter_loss if kind == "block" else eagle3_loss
    fresh = (lambda: tiny_setup()[1]) if kind == "block" else _eagle3
    model_a = block_model if kind == "block" else _eagle3()
    train(model_a, target, seqs, objective, cfg, tmp_path / "a", log_path=tmp_path / "a.jsonl")
    cache = build_feature_cache(target, seqs, [0, 2], tmp_path / "cache", rows_per_shard=5,
                                dtype=torch.bfloat16 if bf16 else torch.float32, autocast=bf16)
    model_b = fresh()
    train(model_b, target, seqs, objective, cfg, tmp_path / "b", log_path=tmp_path / "b.jsonl", features=cache)
    log_a = [json.loads(line) for line in open(tmp_path / "a.jsonl")]
    log_b = [json.loads(line) for line in open(tmp_path / "b.jsonl")]
    assert len(log_a) == cfg.steps
    assert [r["loss"] for r in log_b] == [r["loss"] for r in log_a]
    assert log_b[-1]["accept_rate"] == log_a[-1]["accept_rate"]
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)


def test_cache_returns_the_targets_outputs_for_any_subset_of_its_layers(tmp_path):
    target, _, seqs, _ = tiny_setup()
    cache = build_feature_cache(target, seqs, [0, 1, 2], tmp_path / "c", dtype=torch.float32, autocast=False,
                                rows_per_shard=2)  # 6 shards: more than the reader keeps open at once
    for row in (0, 7, 11, 2, 5, 9, 0):
        feats, _, logits = target_outputs(target, seqs[row][0], [2, 0])
        c_feats, c_logits = cache.target_pass(row, target, [2, 0])
        assert torch.equal(c_feats, feats)
        torch.testing.assert_close(c_logits, logits, atol=1e-5, rtol=1e-5)
        assert c_logits.shape == (seqs[row][0].numel(), 96)


def test_cache_that_does_not_fit_fails_naming_the_field(tmp_path):
    target, _, seqs, _ = tiny_setup()
    cache = build_feature_cache(target, seqs, [0, 2], tmp_path / "c", dtype=torch.float32, autocast=False)
    cache.check(target, seqs, [2], autocast_bf16=False)  # a subset of the cached layers fits
    cases = [
        ((tiny_qwen3(layers=4, seed=5), seqs, [0, 2], False), "target is"),
        ((target, seqs[:-1], [0, 2], False), "num_rows is 12 in the cache but 11 here"),
        ((target, [(seqs[0][0].flip(0), seqs[0][1])] + seqs[1:], [0, 2], False), "data is"),
        ((target, seqs, [0, 1], False), "target_layer_ids is [0, 2] in the cache but the drafter reads [0, 1]"),
        ((target, seqs, [0, 2], True), "autocast_bf16 is False in the cache but True here"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            cache.check(*args[:3], autocast_bf16=args[3])
    with pytest.raises(ValueError, match="holds another feature cache: num_rows is 12 there but 11"):
        build_feature_cache(target, seqs[:-1], [0, 2], tmp_path / "c", dtype=torch.float32, autocast=False)
    assert FeatureCache(tmp_path / "c").meta["num_rows"] == 12  # the existing cache is untouched
    with pytest.raises(FileNotFoundError, match="not a finished feature cache"):
        FeatureCache(tmp_path / "nothing")


def test_killed_build_resumes_at_the_unfinished_shards(tmp_path):
    target, _, seqs, _ = tiny_setup()
    out = tmp_path / "c"
    build_feature_cache(target, seqs, [0, 2], out, rows_per_shard=4, dtype=torch.float32, autocast=False)
    shards = sorted(out.glob("shard-*.safetensors"))
    assert len(shards) == 3
    # A build killed while writing shard 1: no index yet, shard 1 torn, shard 2 not written.
    meta = (out / "index.json").read_text()
    (out / "index.json").unlink()
    (out / "building.json").write_text(meta)
    shards[1].write_bytes(b"torn")
    shards[2].unlink()
    first = shards[0].stat().st_mtime_ns
    cache = build_feature_cache(target, seqs, [0, 2], out, rows_per_shard=4, dtype=torch.float32, autocast=False)
    assert shards[0].stat().st_mtime_ns == first  # the finished shard was kept
    assert not (out / "building.json").exists()
    for row in range(12):
        feats, _, _ = target_outputs(target, seqs[row][0], [0, 2])
        assert torch.equal(cache.target_pass(row, target, [0, 2])[0], feats)


def test_target_whose_logits_are_post_processed_is_refused(tmp_path):
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, final_logit_softcapping=0.5, max_position_embeddings=128)
    gemma = Gemma2ForCausalLM(cfg).eval()
    seqs = tiny_setup()[2][:2]
    with pytest.raises(ValueError, match="soft-capping"):
        build_feature_cache(gemma, seqs, [0], tmp_path / "g", dtype=torch.float32, autocast=False)
