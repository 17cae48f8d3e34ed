"""`dspark export`: every bundled drafter kind in the form vLLM serves, read back by dspark with the same
weights and the same sampled drafts (so a wrong weight or layer mapping fails), calibration beside it."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from dspark.api import encode_prompt, load_drafter
from dspark.decoding import decode
from dspark.drafters.block import BlockDrafter
from dspark.drafters.draft_model import DraftModelDrafter
from dspark.drafters.eagle3 import Eagle3Drafter
from dspark.drafters.ngram import NgramDrafter
from dspark.export import _staging, export_drafter
from dspark.sampling import BatchSampling, SamplingParams
from dspark.zoo import bundled_drafter_path, default_target_path

VERIFIER = {"name_or_path": str(default_target_path().resolve()), "architectures": ["Qwen3ForCausalLM"]}
SHAPE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "vocab_size", "rope_theta", "rms_norm_eps", "max_position_embeddings")


@pytest.fixture(scope="module")
def prompt(bundled_target):
    return [encode_prompt(bundled_target, "List three rivers and say where each one flows.")]


def zoo_config(kind: str) -> dict:
    return json.loads((bundled_drafter_path(kind) / "config.json").read_text())


def read(path) -> dict:
    return json.loads(path.read_text())


def tensor_info(path) -> dict:
    """name -> (shape, dtype) of a safetensors file."""
    with safe_open(str(path), framework="pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def assert_same_drafts(target, original, exported, prompt) -> None:
    """Sampled decoding (T = 1, fixed seed): the drafts' distributions decide every acceptance, so equal
    tokens and equal per-round (drafted, accepted, survival signals) mean equal drafts."""
    def run(drafter):
        return decode(target, drafter, prompt, SamplingParams(temperature=1.0, seed=5), max_new_tokens=16,
                      record_signals=True)[0]

    want, got = run(original), run(exported)
    assert got.token_ids == want.token_ids
    assert repr(got.rounds) == repr(want.rounds)  # repr: the signals hold NaN (no confidence head), != itself
    assert sum(r.accepted for r in want.rounds) > 0  # drafts were used, so the comparison means something


def assert_speculators_block(spec: dict, algorithm: str, tokens: int) -> None:
    assert spec["algorithm"] == algorithm and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": tokens,
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}]
    assert spec["verifier"] == VERIFIER


def assert_calibration(kind: str, out, target) -> None:
    """calibration.json is copied when the drafter has one, and dspark picks it up from the export."""
    src = bundled_drafter_path(kind) / "calibration.json"
    assert (out / "calibration.json").exists() == src.exists()
    if src.exists():
        assert read(out / "calibration.json")["maps"] == read(src)["maps"]
        assert load_drafter(str(out), target).calibration is not None


@pytest.mark.parametrize("kind", ["dspark", "dspark-rnn", "dflash"])
def test_block_drafter_export(tmp_path, bundled_target, prompt, kind):
    out = export_drafter(kind, tmp_path / kind, dtype="float32")
    zoo, cfg = zoo_config(kind), read(out / "config.json")
    method = "dspark" if zoo["markov_rank"] > 0 else "dflash"
    assert cfg["speculators_model_type"] == method and isinstance(cfg["speculators_version"], str)
    assert_speculators_block(cfg["speculators_config"], method, zoo["block_size"])
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in zoo["target_layer_ids"]]  # HF hidden-state index
    for key in ("block_size", "mask_token_id"):
        assert type(cfg[key]) is int and cfg[key] == zoo[key]
    assert cfg["sample_from_anchor"] is True and cfg["draft_vocab_size"] == zoo["vocab_size"]
    assert cfg["target_hidden_size"] == zoo["hidden_size"] and "quantization_config" not in cfg
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == zoo["num_hidden_layers"]
    assert {k: layer[k] for k in SHAPE_KEYS} == {k: zoo[k] for k in SHAPE_KEYS}
    if method == "dspark":
        for key in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
            assert cfg[key] == zoo[key] and type(cfg[key]) is type(zoo[key])

    original = load_drafter(kind, bundled_target, calibration=None)
    expected = {k: (tuple(v.shape), "F32") for k, v in original.model.state_dict().items()}
    assert tensor_info(out / "model.safetensors") == expected
    back = load_drafter(str(out), bundled_target, calibration=None)
    assert isinstance(back, BlockDrafter) and back.cfg == original.cfg
    assert_same_weights(original.model, back.model)
    assert_same_drafts(bundled_target, original, back, prompt)
    assert_calibration(kind, out, bundled_target)


def test_eagle3_export(tmp_path, bundled_target, prompt):
    out = export_drafter("eagle3", tmp_path / "eagle3", dtype="float32")
    zoo, cfg = zoo_config("eagle3"), read(out / "config.json")
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3DraftModel"]
    assert_speculators_block(cfg["speculators_config"], "eagle3", zoo["ttt_length"])
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 1 and layer["hidden_act"] == "silu"
    assert {k: layer[k] for k in SHAPE_KEYS} == {k: zoo[k] for k in SHAPE_KEYS}
    assert type(cfg["draft_vocab_size"]) is int and cfg["draft_vocab_size"] == zoo["vocab_size"]  # full vocabulary
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in zoo["target_layer_ids"]]
    assert cfg["norm_before_residual"] is False and cfg["target_hidden_size"] == zoo["hidden_size"]

    d, heads, kv, hd, inter, vocab = (zoo[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                       "head_dim", "intermediate_size", "vocab_size"))
    info = tensor_info(out / "model.safetensors")
    assert "d2t" not in info and "t2d" not in info  # the draft vocabulary is the target's
    assert info["fc.weight"] == ((d, len(zoo["target_layer_ids"]) * d), "F32")
    assert info["layers.0.self_attn.q_proj.weight"][0] == (heads * hd, 2 * d)
    assert info["layers.0.self_attn.k_proj.weight"][0] == (kv * hd, 2 * d)
    assert info["layers.0.mlp.down_proj.weight"][0] == (d, inter)
    assert info["layers.0.hidden_norm.weight"][0] == (d,) and info["norm.weight"][0] == (d,)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:  # frozen copies of the target's
        assert torch.equal(f.get_tensor("embed_tokens.weight"), bundled_target.model.get_input_embeddings().weight)
        assert torch.equal(f.get_tensor("lm_head.weight"), bundled_target.model.get_output_embeddings().weight)
        assert f.get_tensor("lm_head.weight").shape == (vocab, d)

    original = load_drafter("eagle3", bundled_target, calibration=None)
    assert set(info) == set(original.model.state_dict()) | {"embed_tokens.weight", "lm_head.weight"}
    back = load_drafter(str(out), bundled_target, calibration=None)
    assert isinstance(back, Eagle3Drafter) and back.cfg == original.cfg and back.gamma == original.gamma
    assert_same_weights(original.model, back.model)
    assert_same_drafts(bundled_target, original, back, prompt)
    assert_calibration("eagle3", out, bundled_target)
    again = export_drafter(str(out), tmp_path / "again", dtype="float32")  # an export exports to itself
    assert read(again / "config.json") == cfg and tensor_info(again / "model.safetensors") == info


def test_draft_model_export(tmp_path, bundled_target, prompt):
    out = export_drafter("draft-model", tmp_path / "draft", dtype="float32")
    zoo, cfg = zoo_config("draft-model"), read(out / "config.json")
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["num_hidden_layers"] == zoo["num_hidden_layers"]
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    assert read(out / "vllm_speculative_config.json") == {
        "method": "draft_model", "model": str(out.resolve()), "num_speculative_tokens": 4}
    assert '"method": "draft_model"' in (out / "README.md").read_text()

    original = load_drafter("draft-model", bundled_target, calibration=None)
    names = set(tensor_info(out / "model.safetensors"))
    assert "model.embed_tokens.weight" in names and names <= set(original.lm.model.state_dict())
    back = load_drafter(str(out), bundled_target, calibration=None)
    assert isinstance(back, DraftModelDrafter) and back.gamma == original.gamma
    assert_same_weights(original.lm.model, back.lm.model)
    assert_same_drafts(bundled_target, original, back, prompt)
    assert_calibration("draft-model", out, bundled_target)


def test_ngram_export(tmp_path, bundled_target, prompt):
    out = export_drafter("ngram", tmp_path / "ngram")
    spec = read(out / "vllm_speculative_config.json")
    original = load_drafter("ngram", bundled_target, calibration=None)
    assert spec == {"method": "ngram", "num_speculative_tokens": original.gamma,
                    "prompt_lookup_max": original.max_n, "prompt_lookup_min": original.min_n}
    assert all(type(v) is int for k, v in spec.items() if k != "method")
    assert not (out / "config.json").exists() and not list(out.glob("*.safetensors"))
    assert read(out / "calibration.json") == read(bundled_drafter_path("ngram") / "calibration.json")
    rebuilt = NgramDrafter(gamma=spec["num_speculative_tokens"], min_n=spec["prompt_lookup_min"],
                           max_n=spec["prompt_lookup_max"])
    sequences = [prompt[0] + prompt[0][:12], prompt[0][:20] + prompt[0][5:9]]  # suffixes that occurred before
    sampling = BatchSampling.from_params([SamplingParams()] * 2, "cpu")
    want = original.propose(sequences, sampling, [None, None])
    got = rebuilt.propose(sequences, sampling, [None, None])
    assert want.lengths.tolist() == got.lengths.tolist() and min(want.lengths.tolist()) > 0
    assert torch.equal(want.tokens, got.tokens)


def test_refusals_name_the_argument_and_keep_existing_files(tmp_path):
    with pytest.raises(ValueError, match="drafter: unknown drafter 'no-such-drafter'"):
        export_drafter("no-such-drafter", tmp_path / "x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"out: .*full exists and is not empty; pass overwrite=True"):
        export_drafter("ngram", full)
    assert (full / "keep.txt").read_text() == "mine"
    export_drafter("ngram", full, overwrite=True)
    assert sorted(p.name for p in full.iterdir()) == ["README.md", "calibration.json", "vllm_speculative_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no temporary folders left


def test_a_crash_while_writing_leaves_no_half_export(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="crash"):
        with _staging(out) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []


def test_cli_export_and_bad_drafter(tmp_path):
    out = tmp_path / "spec"
    cli = [sys.executable, "-m", "dspark.cli", "export"]
    ok = subprocess.run(cli + ["dspark", str(out)], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert read(out / "config.json")["speculators_model_type"] == "dspark"
    assert {dtype for _, dtype in tensor_info(out / "model.safetensors").values()} == {"BF16"}  # the default
    bad = subprocess.run(cli + ["no-such-drafter", str(tmp_path / "bad")], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "no-such-drafter" in bad.stderr
    assert not (tmp_path / "bad").exists()
