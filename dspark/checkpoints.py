"""Drafter checkpoints: `config.json` + `model.safetensors`, in dspark's own format and the published ones.

Formats, told apart by config.json:
- DeepSpec / dspark block drafters: `architectures: ["Qwen3DSparkModel"]`, top-level `block_size`,
  `target_layer_ids`, `mask_token_id`, `markov_rank`, `enable_confidence_head`; all slots predict the
  next token (γ drafts). DFlash is the same class with markov_rank 0 and no confidence head. The file
  may hold frozen copies of the target's `embed_tokens` / `lm_head`; the target's own are used.
- z-lab DFlash: a `dflash_config` dict (`target_layer_ids`, `mask_token_id`, maybe `block_size`) and a
  top-level `block_size`; no embedding or LM head; slot 0 is discarded (γ − 1 drafts).
dspark writes the DeepSpec layout (plus `dspark_slot_convention`), so its drafters load there too.
A dspark checkpoint may store its matrices as int8 rows with float32 `<name>_scale` tensors (its
config.json then has a `quantization_config`, see dspark.quantize); loading dequantizes them.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from dspark.atomic import (NO_PICKLE, FileReadError, load_safetensors, pickle_files, read_json,
                           save_safetensors_atomic, write_text_atomic)
from dspark.drafters.block import DSparkModel
from dspark.drafters.dflash_model import DFlashConfig
from dspark.quantize import dequantize_state_dict, quantization_config, quantize_state_dict
from dspark.target import CausalLM

SHARED_KEYS = ("embed_tokens.weight", "lm_head.weight")


class CheckpointMismatch(ValueError):
    """A drafter checkpoint that does not fit the target it is loaded for."""


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return float(cfg.get("rope_theta", params.get("rope_theta", 1_000_000.0)))


def shape_fields(cfg: dict) -> dict:
    """The transformer-shape fields shared by drafter and HF target configs (attention, widths, RoPE)."""
    heads = int(cfg["num_attention_heads"])
    return dict(
        hidden_size=int(cfg["hidden_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
    )


def shape_dict(c) -> dict:
    """The inverse of shape_fields: a drafter config's transformer shape as Qwen3 config.json fields."""
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")
    return {"model_type": "qwen3", **{k: getattr(c, k) for k in keys}}


def detect_format(cfg: dict) -> str:
    """'dspark' (DeepSpec layout), 'zlab-dflash' or 'eagle3' from a checkpoint's config dict."""
    arch = (cfg.get("architectures") or [""])[0]
    if "dflash_config" in cfg:
        return "zlab-dflash"
    if arch in ("Qwen3DSparkModel", "DSparkModel") or "markov_rank" in cfg:
        return "dspark"
    if arch in ("Qwen3Eagle3Model", "Eagle3DraftModel"):
        return "eagle3"
    raise ValueError(f"unrecognised drafter checkpoint (architectures={cfg.get('architectures')})")


def block_config_from_dict(cfg: dict) -> DFlashConfig:
    """DFlashConfig from a DeepSpec or z-lab config dict."""
    fmt = detect_format(cfg)
    if fmt == "eagle3":
        raise ValueError("an EAGLE-3 checkpoint is not a block drafter")
    dflash = cfg.get("dflash_config", {})
    pick = (lambda k, d=None: dflash.get(k, cfg.get(k, d))) if fmt == "zlab-dflash" else (lambda k, d=None: cfg.get(k, d))
    for key in ("target_layer_ids", "mask_token_id", "block_size"):
        if pick(key) is None:
            raise ValueError(f"required field {key!r} is missing")
    rank = int(cfg.get("markov_rank", 0) or 0)
    return DFlashConfig(
        **shape_fields(cfg),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        target_layer_ids=[int(i) for i in pick("target_layer_ids")],
        mask_token_id=int(pick("mask_token_id")),
        block_size=int(pick("block_size")),
        slot_convention=cfg.get("dspark_slot_convention", "self" if fmt == "zlab-dflash" else "next"),
        markov_rank=rank,
        markov_head_type=cfg.get("markov_head_type", "vanilla") if rank > 0 else "vanilla",
        enable_confidence_head=bool(cfg.get("enable_confidence_head", False)),
        confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", True)),
    )


def check_fits_target(cfg: DFlashConfig, target: CausalLM, num_target_layers: int | None = None) -> None:
    """Raise CheckpointMismatch naming the field and both values when the drafter does not fit the target."""
    problems = _check_common(cfg.hidden_size, cfg.vocab_size, cfg.target_layer_ids, target, num_target_layers)
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id is {cfg.mask_token_id} in the drafter but the target's vocabulary has "
                        f"{target.vocab_size} rows")
    if problems:
        raise CheckpointMismatch("drafter does not fit the target: " + "; ".join(problems))


def _weights(model, dtype: torch.dtype | None, int8: bool = False) -> dict[str, torch.Tensor]:
    weights = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if int8:  # quantized from the model's own precision; the remaining vectors take `dtype`
        return quantize_state_dict(weights, dtype)
    return weights if dtype is None else {k: v.to(dtype) for k, v in weights.items()}


def _write(path: Path, cfg: dict, model, dtype: torch.dtype | None, int8: bool) -> None:
    """model.safetensors, then config.json (with a quantization_config when int8), each atomically."""
    if int8:
        cfg = {**cfg, "quantization_config": quantization_config()}
    save_safetensors_atomic(path / "model.safetensors", _weights(model, dtype, int8), metadata={"format": "pt"})
    write_text_atomic(path / "config.json", json.dumps(cfg, indent=2) + "\n")


def read_config(path: Path) -> dict:
    """The drafter folder's config.json; a missing or malformed one raises FileReadError naming the file."""
    raw = read_json(path / "config.json", "drafter config")
    if not isinstance(raw, dict):
        raise FileReadError(f"drafter config {path / 'config.json'} is not a JSON object")
    return raw


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """path/model.safetensors; a folder holding only pickled weights is refused, never unpickled."""
    file = path / "model.safetensors"
    pickled = pickle_files(path)
    if not file.exists() and pickled:
        raise FileReadError(f"drafter folder {path} has no model.safetensors, only {', '.join(pickled)}: {NO_PICKLE}")
    return load_safetensors(file, "drafter weights")[0]


def _load_weights(model: torch.nn.Module, path: Path, target: CausalLM) -> torch.nn.Module:
    """Fill `model` from path/model.safetensors; frozen target copies (embed_tokens, lm_head) are checked
    against the target's shapes and dropped, since the target's own modules are used."""
    weights = dequantize_state_dict(_read_weights(path))
    shapes = {"embed_tokens.weight": tuple(target.model.get_input_embeddings().weight.shape),
              "lm_head.weight": tuple(target.model.get_output_embeddings().weight.shape)}
    for key in SHARED_KEYS:
        if key in weights:
            if tuple(weights[key].shape) != shapes[key]:
                raise CheckpointMismatch(f"drafter does not fit the target: {key} has shape "
                                         f"{tuple(weights[key].shape)} in the drafter but {shapes[key]} in the target")
            del weights[key]
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointMismatch(f"checkpoint {path} does not match its config: missing {missing[:5]}, "
                                 f"unexpected {unexpected[:5]}")
    return model.to(device=target.device, dtype=target.dtype)


def save_block_drafter(model: DSparkModel, path: str | Path, target: CausalLM, extra: dict | None = None,
                       dtype: torch.dtype | None = None, int8: bool = False) -> Path:
    """Write a block drafter as DeepSpec-layout config.json + model.safetensors (no target copies).

    dtype, when given, is the dtype of the stored weights (bf16 halves a zoo drafter's size); `int8`
    stores its matrices as int8 rows with float32 scales (dspark.quantize), half of bf16 again.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = model.cfg
    cfg = {
        "architectures": ["Qwen3DSparkModel"],
        **shape_dict(c),
        "num_hidden_layers": c.num_hidden_layers,
        "layer_types": ["full_attention"] * c.num_hidden_layers,
        "tie_word_embeddings": False,
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "target_layer_ids": list(c.target_layer_ids),
        "num_target_layers": int(target.model.config.num_hidden_layers),
        "markov_rank": c.markov_rank,
        "enable_confidence_head": c.enable_confidence_head,
        "dspark_slot_convention": c.slot_convention,
    }
    if c.markov_rank > 0:
        cfg["markov_head_type"] = c.markov_head_type
    if c.enable_confidence_head:
        cfg["confidence_head_with_markov"] = c.confidence_head_with_markov
    cfg.update(extra or {})
    _write(path, cfg, model, dtype, int8)
    return path


@contextmanager
def _reading_config(path: Path):
    """Re-raise a malformed config's ValueError / KeyError / TypeError naming the config file."""
    try:
        yield
    except CheckpointMismatch:
        raise
    except KeyError as err:
        raise ValueError(f"drafter config {path / 'config.json'}: required field {err.args[0]!r} is missing") from None
    except (ValueError, TypeError) as err:
        raise ValueError(f"drafter config {path / 'config.json'}: {err}") from None


def load_block_drafter_model(path: str | Path, target: CausalLM) -> DSparkModel:
    """Load a DeepSpec / dspark / z-lab block drafter for `target`, checking that it fits."""
    path = Path(path)
    raw = read_config(path)
    with _reading_config(path):
        cfg = block_config_from_dict(raw)
    check_fits_target(cfg, target, raw.get("num_target_layers"))
    return _load_weights(DSparkModel(cfg), path, target)


def export_speculators(
    model: DSparkModel, path: str | Path, target: CausalLM, verifier_name_or_path: str, version: str = "0.3.0"
) -> Path:
    """Write the drafter with a vLLM `speculators_config` block (method dspark or dflash) for serving at scale."""
    c = model.cfg
    method = "dspark" if (c.markov_rank > 0 or c.enable_confidence_head) else "dflash"
    tcfg = target.model.config
    extra = {
        "speculators_model_type": method,
        "speculators_version": version,
        "speculators_config": {
            "algorithm": method,
            "proposal_methods": [{
                "proposal_type": "greedy",
                "speculative_tokens": c.num_drafts,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path,
                         "architectures": list(tcfg.architectures or [type(target.model).__name__])},
        },
        "transformer_layer_config": {**shape_dict(c), "num_hidden_layers": c.num_hidden_layers},
        "draft_vocab_size": c.vocab_size,
        "target_hidden_size": int(tcfg.hidden_size),
        # HF hidden-state indices (0 = the embedding output), as speculators and vLLM count them
        "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "sample_from_anchor": c.slot_convention == "next",
    }
    if method == "dspark":
        extra["confidence_head_with_markov"] = c.confidence_head_with_markov
        extra["markov_head_type"] = c.markov_head_type
    return save_block_drafter(model, path, target, extra)


def eagle3_config_from_dict(cfg: dict) -> "Eagle3Config":
    """Eagle3Config from a DeepSpec `Qwen3Eagle3Model` (or dspark) config dict."""
    from dspark.drafters.eagle3 import Eagle3Config

    if int(cfg.get("draft_num_hidden_layers", 1)) != 1:
        raise ValueError(f"EAGLE-3 drafters have one layer; config says {cfg['draft_num_hidden_layers']}")
    return Eagle3Config(
        **shape_fields(cfg),
        target_layer_ids=[int(i) for i in cfg["target_layer_ids"]],
        ttt_length=int(cfg.get("ttt_length", 7)),
        step_loss_decay=float(cfg.get("step_loss_decay", 0.8)),
    )


def _check_common(hidden: int, vocab: int, layer_ids: list[int], target: CausalLM, num_target_layers) -> list[str]:
    t_layers = int(target.model.config.num_hidden_layers)
    problems = []
    if hidden != int(target.model.config.hidden_size):
        problems.append(f"hidden_size is {hidden} in the drafter but {target.model.config.hidden_size} in the target")
    if vocab != target.vocab_size:
        problems.append(f"vocab_size is {vocab} in the drafter but {target.vocab_size} in the target")
    if num_target_layers is not None and int(num_target_layers) != t_layers:
        problems.append(f"num_target_layers is {num_target_layers} in the drafter but the target has {t_layers} layers")
    bad = [i for i in layer_ids if i < -1 or i >= t_layers - 1]
    if bad:
        problems.append(f"target_layer_ids {layer_ids} include {bad}, outside [-1, {t_layers - 2}] "
                        f"for a {t_layers}-layer target (the final layer is post-norm)")
    return problems


def save_eagle3_drafter(model, path: str | Path, target: CausalLM, target_name: str = "",
                        dtype: torch.dtype | None = None, int8: bool = False) -> Path:
    """Write an EAGLE-3 drafter in DeepSpec's `Qwen3Eagle3Model` layout (no target copies); dtype and
    int8 as in save_block_drafter."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = model.cfg
    cfg = {
        "architectures": ["Qwen3Eagle3Model"], **shape_dict(c),
        "draft_num_hidden_layers": 1, "ttt_length": c.ttt_length, "step_loss_decay": c.step_loss_decay,
        "target_layer_ids": list(c.target_layer_ids), "num_target_layers": int(target.model.config.num_hidden_layers),
        "target_model_name_or_path": target_name, "tie_word_embeddings": False,
    }
    _write(path, cfg, model, dtype, int8)
    return path


def eagle3_fields_from_speculators(raw: dict) -> dict:
    """A vLLM speculators EAGLE-3 config (`speculators_model_type: "eagle3"`, as `dspark export` writes) as
    DeepSpec-layout fields; any other config is returned as is. Its aux layer ids count HF hidden states
    (0 = the embedding output), so target_layer_ids = aux id − 1. Variants dspark does not run are refused."""
    if raw.get("speculators_model_type") != "eagle3":
        return raw
    layer = raw["transformer_layer_config"]
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(flag):
            raise ValueError(f"speculators EAGLE-3 checkpoint sets {flag}, which dspark's EAGLE-3 drafter lacks")
    if raw.get("draft_vocab_size", layer["vocab_size"]) != layer["vocab_size"]:
        raise ValueError(f"speculators EAGLE-3 checkpoint has a reduced draft vocabulary (draft_vocab_size "
                         f"{raw['draft_vocab_size']} < {layer['vocab_size']}); dspark drafts over the full vocabulary")
    if not raw.get("eagle_aux_hidden_state_layer_ids"):
        raise ValueError("speculators EAGLE-3 checkpoint lacks eagle_aux_hidden_state_layer_ids")
    proposals = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return {**layer, "draft_num_hidden_layers": layer.get("num_hidden_layers", 1),
            "target_layer_ids": [int(i) - 1 for i in raw["eagle_aux_hidden_state_layer_ids"]],
            "ttt_length": proposals[0].get("speculative_tokens", 7)}


def load_eagle3_model(path: str | Path, target: CausalLM):
    """Load a DeepSpec / dspark / speculators-format EAGLE-3 drafter for `target`, checking that it fits."""
    from dspark.drafters.eagle3 import Eagle3Model

    path = Path(path)
    raw = read_config(path)
    with _reading_config(path):
        raw = eagle3_fields_from_speculators(raw)
        cfg = eagle3_config_from_dict(raw)
    problems = _check_common(cfg.hidden_size, cfg.vocab_size, cfg.target_layer_ids, target, raw.get("num_target_layers"))
    if problems:
        raise CheckpointMismatch("drafter does not fit the target: " + "; ".join(problems))
    return _load_weights(Eagle3Model(cfg), path, target)
