"""int8 storage of drafters: bounded rounding error, smaller files, lossless decoding, clear errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dspark
from dspark.checkpoints import load_block_drafter_model, save_block_drafter, save_eagle3_drafter
from dspark.drafters.block import BlockDrafter, DSparkModel
from dspark.quantize import METHOD, dequantize_state_dict, is_quantized, quantize_state_dict
from dspark.target import CausalLM
from dspark.training.trainer import save_train_state
from tests.conftest import tiny_qwen3
from tests.test_checkpoints import assert_lossless
from tests.training_fixtures import tiny_block_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target():
    return CausalLM(tiny_qwen3(layers=6))


def test_rowwise_int8_error_is_at_most_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g) * torch.linspace(0.01, 3.0, 64).unsqueeze(1)  # rows of very different range
    weights = {"m.weight": w, "norm.weight": torch.randn(128, generator=g), "small.weight": torch.randn(8, 8, generator=g)}
    q = quantize_state_dict(weights, other_dtype=torch.bfloat16)
    assert q["m.weight"].dtype == torch.int8 and q["m.weight_scale"].shape == (64,)
    assert q["m.weight_scale"].dtype == torch.float32
    assert q["norm.weight"].dtype == torch.bfloat16 and "norm.weight_scale" not in q  # vectors stay float
    assert q["small.weight"].dtype == torch.bfloat16  # under min_numel
    assert int(q["m.weight"].abs().max()) == 127
    assert is_quantized(q) and not is_quantized(weights)
    back = dequantize_state_dict(q)
    assert set(back) == set(weights)
    step = q["m.weight_scale"].unsqueeze(1)
    assert bool(((back["m.weight"] - w).abs() <= step / 2 + 1e-6).all())


def test_int8_block_drafter_is_smaller_close_and_lossless(tmp_path, target):
    torch.manual_seed(0)
    model = DSparkModel(tiny_block_config(target_layer_ids=[0, 2, 4], num_hidden_layers=2, block_size=5))
    torch.nn.init.normal_(model.markov_head.markov_w2.weight, std=0.3)
    save_block_drafter(model, tmp_path / "bf16", target, dtype=torch.bfloat16)
    save_block_drafter(model, tmp_path / "int8", target, dtype=torch.bfloat16, int8=True)
    cfg = json.loads((tmp_path / "int8" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == METHOD and cfg["quantization_config"]["bits"] == 8
    stored = load_file(str(tmp_path / "int8" / "model.safetensors"))
    assert stored["layers.0.mlp.up_proj.weight"].dtype == torch.int8
    size = {k: (tmp_path / k / "model.safetensors").stat().st_size for k in ("bf16", "int8")}
    assert size["int8"] < 0.65 * size["bf16"]
    loaded = load_block_drafter_model(tmp_path / "int8", target)
    for name, p in model.state_dict().items():
        got = loaded.state_dict()[name].float()
        assert torch.allclose(got, p.float(), atol=p.abs().max().item() / 127 + 1e-2), name
    assert_lossless(target, dspark.load_drafter(str(tmp_path / "int8"), target), expected_drafts=5)


def test_int8_eagle3_drafter_is_lossless(tmp_path, target):
    from dspark.drafters.eagle3 import Eagle3Config, Eagle3Model

    torch.manual_seed(0)
    model = Eagle3Model(Eagle3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     intermediate_size=128, vocab_size=96, target_layer_ids=[0, 2, 4], ttt_length=4))
    save_eagle3_drafter(model, tmp_path, target, int8=True)
    assert is_quantized(load_file(str(tmp_path / "model.safetensors")))
    assert_lossless(target, dspark.load_drafter(str(tmp_path), target), expected_drafts=4)


def test_int8_matrix_without_its_scale_is_refused(tmp_path, target):
    model = DSparkModel(tiny_block_config(target_layer_ids=[0, 2, 4]))
    save_block_drafter(model, tmp_path, target, int8=True)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["fc.weight_scale"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="int8 tensor 'fc.weight' has no 'fc.weight_scale'"):
        dspark.load_drafter(str(tmp_path), target)


def test_install_drafter_quantizes_from_the_float32_train_state(tmp_path, target):
    torch.manual_seed(0)
    model = DSparkModel(tiny_block_config(target_layer_ids=[0, 2, 4]))
    src, dst = tmp_path / "run", tmp_path / "zoo"
    save_block_drafter(model, src, target, dtype=torch.bfloat16)
    save_train_state(src / "_train_state", model, torch.optim.AdamW(model.parameters()), 7, {})
    (src / "train_log.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8)))
    (src / "README.md").write_text("# card\n")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "install_drafter.py"), str(src), str(dst), "--int8",
                    "--every", "2"], check=True, cwd=ROOT)
    stored = load_file(str(dst / "model.safetensors"))
    want = quantize_state_dict({"fc.weight": model.fc.weight.detach().float()})  # from float32, not from bf16
    assert torch.equal(stored["fc.weight"], want["fc.weight"])
    assert stored["hidden_norm.weight"].dtype == torch.bfloat16
    assert [json.loads(line)["step"] for line in (dst / "train_log.jsonl").read_text().splitlines()] == [2, 4, 6, 7]
    assert "int8" in (dst / "README.md").read_text()
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["quant_method"] == METHOD
    assert isinstance(dspark.load_drafter(str(dst), target), BlockDrafter)
