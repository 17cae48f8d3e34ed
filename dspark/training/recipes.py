"""Drafter recipes: build a DFlash / DSpark / DSpark-RNN / EAGLE-3 drafter sized for a target, train, save."""
from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import torch

from dspark.atomic import write_text_atomic
from dspark.checkpoints import save_block_drafter, save_eagle3_drafter, shape_fields
from dspark.drafters.block import DSparkModel
from dspark.drafters.dflash_model import DFlashConfig
from dspark.drafters.eagle3 import Eagle3Config, Eagle3Model
from dspark.target import CausalLM
from dspark.training.block_objective import block_drafter_loss
from dspark.training.data import training_sequences
from dspark.training.eagle3_objective import eagle3_loss
from dspark.training.feature_cache import build_feature_cache
from dspark.training.losses import DFLASH_WEIGHTS, DSPARK_WEIGHTS
from dspark.training.trainer import TrainConfig, init_distributed, train

KINDS = ("dflash", "dspark", "dspark-rnn", "eagle3")


def spread_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """Target layers spread evenly from layer 1 to L−3 (the z-lab rule); the middle layer when count is 1."""
    if count == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (count - 1)) for i in range(count)]


def build_drafter(kind: str, target: CausalLM, layers: int = 1, block_size: int = 7, markov_rank: int = 32,
                  num_feature_layers: int = 5, intermediate_size: int | None = None,
                  markov_head: str = "vanilla") -> torch.nn.Module:
    """A fresh drafter of `kind` whose width, heads and vocabulary follow the target's config.

    `intermediate_size` sets the draft layers' MLP width (default: the target's); `markov_head` picks
    dspark's head type ("vanilla" or "gated").
    """
    if markov_head not in ("vanilla", "gated"):
        raise ValueError(f"markov_head must be 'vanilla' or 'gated', got {markov_head!r}")
    if markov_head != "vanilla" and kind != "dspark":
        raise ValueError(f"markov_head={markov_head!r} applies to the dspark kind only, not {kind!r}")
    if kind not in KINDS:
        raise ValueError(f"unknown drafter kind {kind!r}; choose one of {', '.join(KINDS)}")
    tc = target.model.config
    common = shape_fields(tc.to_dict()) | {
        "vocab_size": target.vocab_size,
        "target_layer_ids": spread_layer_ids(int(tc.num_hidden_layers), num_feature_layers),
    }
    if intermediate_size:
        common["intermediate_size"] = int(intermediate_size)
    if kind == "eagle3":
        return Eagle3Model(Eagle3Config(**common, ttt_length=block_size))
    mask_id = getattr(target.tokenizer, "mask_token_id", None)
    if mask_id is None:
        raise ValueError("the target's tokenizer has no mask token; block drafters need one")
    cfg = DFlashConfig(
        **common, num_hidden_layers=layers, mask_token_id=int(mask_id), block_size=block_size,
        markov_rank=0 if kind == "dflash" else markov_rank,
        markov_head_type="rnn" if kind == "dspark-rnn" else markov_head,
        enable_confidence_head=kind != "dflash",
    )
    return DSparkModel(cfg)


def train_drafter(kind: str, target: CausalLM, data: str | Path, out: str | Path, cfg: TrainConfig,
                  layers: int = 1, block_size: int = 7, markov_rank: int = 32, max_len: int = 768,
                  num_anchors: int = 64, save_dtype: torch.dtype | None = torch.bfloat16,
                  intermediate_size: int | None = None, int8: bool = False, markov_head: str = "vanilla",
                  feature_cache: str | Path | None = None, tensorboard: bool = False) -> dict:
    """Train a drafter of `kind` on regenerated data and save it with a card; return the last log entry.

    The weights are stored in `save_dtype`, or as int8 rows with float32 scales when `int8`.
    `feature_cache`: a folder for the target's features of the data (built on first use, then reused
    by any run on the same data, target and layers) instead of a target forward pass per step.
    `tensorboard`: also log to TensorBoard events in `out/tensorboard`.
    """
    out = Path(out)
    torch.manual_seed(cfg.seed)
    model = build_drafter(kind, target, layers, block_size, markov_rank,
                          intermediate_size=intermediate_size, markov_head=markov_head).to(target.device)
    sequences = training_sequences(data, max_len)
    if kind == "eagle3":
        objective = eagle3_loss
        cfg.objective_kwargs = {}
    else:
        objective = block_drafter_loss
        cfg.objective_kwargs = {"num_anchors": num_anchors, "weights": DFLASH_WEIGHTS if kind == "dflash" else DSPARK_WEIGHTS}
    cache, cache_note = None, "computed on the fly by the frozen target"
    if feature_cache is not None:
        init_distributed(target.device)
        t0 = time.perf_counter()
        cache = build_feature_cache(target.model, sequences, model.cfg.target_layer_ids, feature_cache,
                                    dtype=torch.bfloat16 if cfg.bf16 else torch.float32, autocast=cfg.bf16)
        cache_note = f"read from the feature cache {feature_cache} (ready after {time.perf_counter() - t0:.0f} s)"
    last = train(model, target.model, sequences, objective, cfg, out / "_train_state", log_path=out / "train_log.jsonl",
                 features=cache, tensorboard_dir=out / "tensorboard" if tensorboard else None)
    seconds = last.get("elapsed_s", 0.0)  # over every segment of a resumed run
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return last
    if kind == "eagle3":
        save_eagle3_drafter(model, out, target, dtype=save_dtype, int8=int8)
    else:
        save_block_drafter(model, out, target, dtype=save_dtype, int8=int8)
    params = sum(p.numel() for p in model.parameters())
    peak = _peak_rss_mb()
    threads = torch.get_num_threads()
    card = [
        f"# {kind} drafter for the bundled target", "",
        f"- parameters: {params / 1e6:.2f}M trainable (the target's embedding and LM head are shared, frozen); "
        f"stored as {_storage(save_dtype or model.fc.weight.dtype, int8)}",
        f"- architecture: {json.dumps({k: v for k, v in model.cfg.to_dict().items() if k != 'extra'})}",
        f"- data: {data} ({len(sequences)} target-regenerated conversations, answers only in the loss)",
        f"- training: {cfg.steps} steps x {cfg.batch} sequences, lr {cfg.lr}, warm-up {cfg.warmup_frac:.0%} then cosine, "
        f"AdamW, clip {cfg.max_grad_norm}, bf16 autocast: {cfg.bf16}, seed {cfg.seed}",
        f"- target features: {cache_note}",
        f"- training speed: {last.get('tokens_per_s', 0):.0f} sequence tokens/s; {seconds / 60:.1f} minutes of training; "
        f"peak RSS {peak:.0f} MB ({threads} CPU thread{'s' if threads > 1 else ''})",
        f"- final loss {last.get('loss', float('nan')):.3f}; predicted per-position acceptance (last step): "
        f"{[round(a, 3) for a in last.get('accept_rate', [])]}",
        "", "Built with:", "", "```", _command_line(), "```", "",
    ]
    write_text_atomic(out / "README.md", "\n".join(card))
    return last


def _storage(dtype: torch.dtype, int8: bool) -> str:
    """How the card describes the stored weights."""
    name = str(dtype).replace("torch.", "")
    return f"int8 matrices with float32 row scales, {name} vectors" if int8 else name


def _command_line() -> str:
    """The command that is running, with the console script's path shortened to its name."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("dspark", "cli.py"):
        argv[0] = "dspark"
    return " ".join(shlex.quote(a) for a in argv)


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
