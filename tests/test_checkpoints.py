"""Checkpoint formats: DeepSpec DSpark/DFlash and z-lab DFlash load and decode losslessly; mismatches are named."""
import json

import pytest
import torch
from safetensors.torch import save_file

import dspark
from dspark.checkpoints import export_speculators, load_block_drafter_model, save_block_drafter
from dspark.decoding import decode
from dspark.drafters import NoDrafter
from dspark.drafters.block import BlockDrafter, DSparkModel
from dspark.target import CausalLM
from tests.conftest import tiny_qwen3
from tests.training_fixtures import tiny_block_config

D, H, KV, HD, I, V, R = 64, 4, 2, 16, 128, 96, 8  # the tiny target's sizes, and a Markov rank


@pytest.fixture(scope="module")
def target():
    return CausalLM(tiny_qwen3(layers=6))


def qwen3_fields(num_layers: int) -> dict:
    return {"model_type": "qwen3", "hidden_size": D, "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": HD,
            "intermediate_size": I, "vocab_size": V, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 512, "attention_bias": False, "num_hidden_layers": num_layers,
            "layer_types": ["full_attention"] * num_layers, "tie_word_embeddings": False}


def layer_shapes(num_layers: int) -> dict:
    shapes = {}
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (H * HD, D), p + "self_attn.k_proj.weight": (KV * HD, D),
            p + "self_attn.v_proj.weight": (KV * HD, D), p + "self_attn.o_proj.weight": (D, H * HD),
            p + "self_attn.q_norm.weight": (HD,), p + "self_attn.k_norm.weight": (HD,),
            p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D), p + "mlp.down_proj.weight": (D, I),
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
        })
    return shapes


def write_checkpoint(path, config: dict, shapes: dict, target: CausalLM, seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            tensors[name] = 0.2 * torch.randn(shape, generator=g)
    if "embed_tokens.weight" in shapes:  # DeepSpec stores frozen copies of the target's
        tensors["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().clone()
        tensors["lm_head.weight"] = target.model.get_output_embeddings().weight.detach().clone()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


def deepspec_dspark(path, target, head_type="vanilla", rank=R, confidence=True):
    cfg = qwen3_fields(2) | {
        "architectures": ["Qwen3DSparkModel"], "num_target_layers": 6, "block_size": 7, "mask_token_id": 95,
        "target_layer_ids": [0, 2, 4], "num_anchors": 512, "markov_rank": rank, "enable_confidence_head": confidence,
    }
    shapes = layer_shapes(2) | {"fc.weight": (D, 3 * D), "hidden_norm.weight": (D,), "norm.weight": (D,),
                                "embed_tokens.weight": (V, D), "lm_head.weight": (V, D)}
    if rank:
        cfg["markov_head_type"] = head_type
        shapes |= {"markov_head.markov_w1.weight": (V, rank), "markov_head.markov_w2.weight": (V, rank)}
        if head_type == "gated":
            shapes |= {"markov_head.gate_proj.weight": (rank, D + rank), "markov_head.gate_proj.bias": (rank,)}
        if head_type == "rnn":
            shapes |= {"markov_head.joint_proj.weight": (3 * rank, 2 * rank + D), "markov_head.joint_proj.bias": (3 * rank,)}
    if confidence:
        cfg["confidence_head_with_markov"] = True
        shapes |= {"confidence_head.proj.weight": (1, D + rank), "confidence_head.proj.bias": (1,)}
    write_checkpoint(path, cfg, shapes, target)


def zlab_dflash(path, target, block_size=16):
    cfg = qwen3_fields(2) | {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": block_size, "num_target_layers": 6,
        "dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": 95},
    }
    shapes = layer_shapes(2) | {"fc.weight": (D, 2 * D), "hidden_norm.weight": (D,), "norm.weight": (D,)}
    write_checkpoint(path, cfg, shapes, target)


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21]]


def assert_lossless(target, drafter, expected_drafts):
    ref = decode(target, NoDrafter(), PROMPTS, max_new_tokens=30)
    out = decode(target, drafter, PROMPTS, max_new_tokens=30)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert max(s.draft_len for r in out for s in r.rounds) == expected_drafts


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_deepspec_dspark_checkpoint_loads_and_is_lossless(tmp_path, target, head):
    deepspec_dspark(tmp_path, target, head)
    drafter = dspark.load_drafter(str(tmp_path), target)
    assert isinstance(drafter, BlockDrafter) and drafter.cfg.slot_convention == "next"
    assert drafter.model.markov_head.markov_w1.weight.shape == (V, R)
    assert_lossless(target, drafter, expected_drafts=7)
    start_drafter(target, drafter, PROMPTS[0])
    block = drafter.propose([PROMPTS[0]], *sampling_for(1))
    assert block.confidences is not None and block.confidences.shape == (1, 7)


def start_drafter(target, drafter, seq):
    target.reset(1)
    target.set_feature_layers(drafter.feature_layers)
    drafter.start([seq], target.forward([seq[:-1]], features=True).features)


def sampling_for(n, temperature=0.0):
    from dspark.sampling import BatchSampling, SamplingParams

    return BatchSampling.from_params([SamplingParams(temperature)] * n, "cpu"), [torch.Generator() for _ in range(n)]


def test_deepspec_dflash_checkpoint(tmp_path, target):
    deepspec_dspark(tmp_path, target, rank=0, confidence=False)
    drafter = dspark.load_drafter(str(tmp_path), target)
    assert drafter.model.markov_head is None and drafter.model.confidence_head is None
    assert_lossless(target, drafter, expected_drafts=7)


def test_zlab_dflash_checkpoint_uses_own_slot_convention(tmp_path, target):
    zlab_dflash(tmp_path, target, block_size=16)
    drafter = dspark.load_drafter(str(tmp_path), target)
    assert drafter.cfg.slot_convention == "self" and drafter.gamma == 15
    assert_lossless(target, drafter, expected_drafts=15)
    # slot j of the block predicts its own position: drafts come from hidden slots 1..15
    seq = PROMPTS[0]
    start_drafter(target, drafter, seq)
    h = drafter.block_hidden([seq])
    block = drafter.propose([seq], *sampling_for(1))
    assert block.tokens[0].tolist() == drafter.lm_head(h[0, 1:]).argmax(-1).tolist()


def test_own_format_round_trip_and_sampled_decoding(tmp_path, target):
    torch.manual_seed(0)
    model = DSparkModel(tiny_block_config(target_layer_ids=[0, 2, 4], markov_head_type="rnn"))
    torch.nn.init.normal_(model.markov_head.markov_w2.weight, std=0.3)
    save_block_drafter(model, tmp_path, target)
    loaded = load_block_drafter_model(tmp_path, target)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    drafter = dspark.load_drafter(str(tmp_path), target)
    from dspark.sampling import SamplingParams

    params = [SamplingParams(temperature=1.0, seed=s) for s in range(3)]
    a = decode(target, drafter, PROMPTS, params, max_new_tokens=20)
    b = decode(target, drafter, PROMPTS, params, max_new_tokens=20)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size", 32, "hidden_size is 32 in the drafter but 64 in the target"),
    ("vocab_size", 200, "vocab_size is 200 in the drafter but 96 in the target"),
    ("target_layer_ids", [0, 5], "target_layer_ids [0, 5] include [5]"),
    ("mask_token_id", 500, "mask_token_id is 500 in the drafter but the target's vocabulary has 96 rows"),
    ("num_target_layers", 36, "num_target_layers is 36 in the drafter but the target has 6 layers"),
])
def test_mismatched_checkpoint_names_field_and_values(tmp_path, target, field, value, message):
    deepspec_dspark(tmp_path, target)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not fit the target") as err:
        dspark.load_drafter(str(tmp_path), target)
    assert message in str(err.value)


def test_export_speculators_config(tmp_path, target):
    model = DSparkModel(tiny_block_config(target_layer_ids=[0, 2, 4], block_size=7))
    export_speculators(model, tmp_path, target, "org/tiny-target")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark"
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "dspark" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 7
    assert spec["verifier"] == {"name_or_path": "org/tiny-target", "architectures": ["Qwen3ForCausalLM"]}
    assert cfg["aux_hidden_state_layer_ids"] == [1, 3, 5] and cfg["sample_from_anchor"] is True
    assert cfg["block_size"] == 7 and cfg["mask_token_id"] == 95 and cfg["markov_rank"] == 8
    assert cfg["markov_head_type"] == "vanilla" and cfg["enable_confidence_head"] is True
    assert cfg["draft_vocab_size"] == V and cfg["target_hidden_size"] == D
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    # and it still loads as a dspark drafter
    assert isinstance(dspark.load_drafter(str(tmp_path), target), BlockDrafter)


def deepspec_eagle3(path, target):
    cfg = qwen3_fields(1) | {
        "architectures": ["Qwen3Eagle3Model"], "draft_num_hidden_layers": 1, "ttt_length": 7, "step_loss_decay": 0.8,
        "target_layer_ids": [0, 2, 4], "target_model_name_or_path": "tiny", "num_target_layers": 6,
    }
    p = "layers.0."
    shapes = {
        "fc.weight": (D, 3 * D), "norm.weight": (D,), "embed_tokens.weight": (V, D), "lm_head.weight": (V, D),
        p + "self_attn.q_proj.weight": (H * HD, 2 * D), p + "self_attn.k_proj.weight": (KV * HD, 2 * D),
        p + "self_attn.v_proj.weight": (KV * HD, 2 * D), p + "self_attn.o_proj.weight": (D, H * HD),
        p + "self_attn.q_norm.weight": (HD,), p + "self_attn.k_norm.weight": (HD,),
        p + "hidden_norm.weight": (D,), p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
        p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D), p + "mlp.down_proj.weight": (D, I),
    }
    write_checkpoint(path, cfg, shapes, target)


def test_deepspec_eagle3_checkpoint(tmp_path, target):
    from dspark.drafters.eagle3 import Eagle3Drafter

    deepspec_eagle3(tmp_path, target)
    drafter = dspark.load_drafter(str(tmp_path), target)
    assert isinstance(drafter, Eagle3Drafter) and drafter.gamma == 7
    assert_lossless(target, drafter, expected_drafts=7)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size is 48 in the drafter but 64 in the target"):
        dspark.load_drafter(str(tmp_path), target)


def test_narrow_mlp_drafter_round_trip_is_lossless(tmp_path, bundled_target):
    from dspark.api import encode_prompt
    from dspark.training.recipes import build_drafter

    torch.manual_seed(0)
    model = build_drafter("dspark", bundled_target, layers=2, intermediate_size=96)
    assert model.layers[1].mlp.gate_proj.weight.shape == (96, 320)
    save_block_drafter(model, tmp_path, bundled_target)
    assert json.loads((tmp_path / "config.json").read_text())["intermediate_size"] == 96
    drafter = dspark.load_drafter(str(tmp_path), bundled_target)
    assert drafter.model.layers[0].mlp.down_proj.weight.shape == (320, 96)
    prompt = [encode_prompt(bundled_target, "Name three colours.")]
    want = decode(bundled_target, NoDrafter(), prompt, max_new_tokens=16)[0].token_ids
    assert decode(bundled_target, drafter, prompt, max_new_tokens=16)[0].token_ids == want
