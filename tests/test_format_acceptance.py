"""A trained drafter written in each published checkpoint layout and read back keeps its acceptance.

Losslessness holds for any weights, so a loader that maps weights wrongly still decodes exactly; only the
drafts, and so the acceptance, show it. The bundled trained drafters are rewritten as plain DeepSpec
(`Qwen3DSparkModel` / `Qwen3Eagle3Model`, float weights, frozen target copies included) and z-lab DFlash
(`dflash_config`) checkpoints; every round must accept exactly what the bundled drafter's round accepts, and a
checkpoint with two layers swapped (a wrong mapping) must not.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dspark
from dspark.api import encode_prompt
from dspark.decoding import decode
from dspark.quantize import dequantize_state_dict
from dspark.sampling import SamplingParams
from dspark.zoo import bundled_drafter_path as zoo_path

PROMPTS = ["def merge_sorted(a, b):", "A pen costs $3.50 and a notebook $2.25. Tom buys 4 pens and 2 notebooks. "
           "How much does he pay?"]


def zoo_weights(name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    folder = zoo_path(name)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config", None)
    return cfg, dequantize_state_dict(load_file(str(folder / "model.safetensors")))


def write(path: Path, cfg: dict, weights: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def with_target_copies(weights: dict[str, torch.Tensor], target) -> dict[str, torch.Tensor]:
    """DeepSpec checkpoints carry frozen copies of the target's embeddings and LM head."""
    return {**weights, "embed_tokens.weight": target.model.get_input_embeddings().weight.detach().float().clone(),
            "lm_head.weight": target.model.get_output_embeddings().weight.detach().float().clone()}


def deepspec(name: str, path: Path, target) -> Path:
    cfg, weights = zoo_weights(name)
    assert cfg.pop("dspark_slot_convention", "next") == "next"  # DeepSpec's own convention: the reader's default
    return write(path, cfg, with_target_copies(weights, target))


def zlab(name: str, path: Path, target) -> Path:
    cfg, weights = zoo_weights(name)
    cfg = {k: v for k, v in cfg.items() if k not in ("target_layer_ids", "mask_token_id", "markov_rank",
                                                    "enable_confidence_head")}
    cfg |= {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "dflash_config": {"target_layer_ids": zoo_weights(name)[0]["target_layer_ids"],
                              "mask_token_id": zoo_weights(name)[0]["mask_token_id"]}}
    return write(path, cfg, weights)  # this drafter's slot convention ("next") stays named in the config


def rounds(target, drafter, temperature: float) -> list[list[int]]:
    ids = [encode_prompt(target, p) for p in PROMPTS]
    params = [SamplingParams(temperature, seed=i) for i in range(len(ids))]
    out = decode(target, drafter, ids, params, max_new_tokens=32)
    return [[s.accepted for s in r.rounds] for r in out]


@pytest.mark.parametrize("name, layout", [("dspark", deepspec), ("dspark-rnn", deepspec), ("dflash", deepspec),
                                          ("dflash", zlab), ("eagle3", deepspec)])
def test_trained_drafter_keeps_its_acceptance_through_a_published_layout(tmp_path, bundled_target, name, layout):
    bundled = dspark.load_drafter(name, bundled_target, calibration=None)
    folder = layout(name, tmp_path / "ckpt", bundled_target)
    converted = dspark.load_drafter(str(folder), bundled_target, calibration=None)
    # Sampled (T 1, seeded): every acceptance depends on the drafts' whole distribution q, not just its argmax.
    expected = rounds(bundled_target, bundled, 1.0)
    assert sum(map(sum, expected)) > 0.3 * sum(map(len, expected))  # a trained drafter: drafts get accepted
    assert rounds(bundled_target, converted, 1.0) == expected, (name, layout.__name__)


def test_a_wrong_weight_mapping_loses_acceptance(tmp_path, bundled_target):
    cfg, weights = zoo_weights("dspark")
    cfg.pop("dspark_slot_convention")
    swapped = {k.replace("layers.0.", "layers.#.").replace("layers.1.", "layers.0.").replace("layers.#.", "layers.1."): v
               for k, v in weights.items()}
    folder = write(tmp_path / "swapped", cfg, with_target_copies(swapped, bundled_target))
    wrong = dspark.load_drafter(str(folder), bundled_target, calibration=None)
    good = dspark.load_drafter("dspark", bundled_target, calibration=None)
    accepted_good = sum(map(sum, rounds(bundled_target, good, 0.0)))
    accepted_wrong = sum(map(sum, rounds(bundled_target, wrong, 0.0)))
    assert accepted_wrong < 0.7 * accepted_good  # the acceptance check above would catch this mapping
