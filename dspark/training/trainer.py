"""The drafter training loop: AdamW, warm-up + cosine, clipping, bf16 autocast, exact resume, torchrun DDP.

Launch single-process as a plain call, or with `torchrun --nproc-per-node N` (gloo on CPU, NCCL on
GPU): every rank takes its share of each global batch, `DistributedDataParallel` averages gradients,
so N processes compute the same update as one process with the same global batch. The data order and
the anchors depend only on (seed, step, index in the global batch), so a killed run resumes exactly from
its last checkpoint (model, AdamW moments and step in one safetensors file, written atomically; never pickle).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from dspark.atomic import (FileReadError, load_safetensors, read_json, read_json_lines, remove_stale_temps,
                           save_safetensors_atomic, write_text_atomic)
from dspark.training.data import global_batches
from dspark.training.feature_cache import FeatureCache

Objective = Callable[..., "tuple[torch.Tensor, dict[str, torch.Tensor]] | None"]


@dataclass
class TrainConfig:
    """Optimisation settings (defaults after DeepSpec, scaled to small CPU runs)."""

    steps: int = 100
    batch: int = 8  # global sequences per step
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    num_anchors: int = 64
    seed: int = 42
    ckpt_every: int = 50
    bf16: bool = True
    objective_kwargs: dict = field(default_factory=dict)


def bf16_supported(device: torch.device | str) -> bool:
    """Whether bf16 autocast runs natively on `device` (CPUs do; CUDA from Ampere on; emulation does not count)."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch without the argument
            return torch.cuda.is_bf16_supported()
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            x = torch.ones(2, 2, device=device)
            (x @ x).sum().item()
        return True
    except (RuntimeError, AssertionError):
        return False


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over warmup_frac of the steps, then cosine decay to zero."""
    warm = max(1, int(cfg.warmup_frac * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class _BatchLoss(nn.Module):
    """Mean objective over this rank's sequences; a module so DDP sees one forward per step."""

    def __init__(self, model: nn.Module, objective: Objective, features: FeatureCache | None = None) -> None:
        super().__init__()
        self.model = model
        self.objective = objective
        self.features = features

    def forward(self, target_model, sequences, generators, kwargs, rows):  # noqa: D102
        losses, stats = [], []
        for (ids, mask), gen, row in zip(sequences, generators, rows):
            if self.features is not None:
                kwargs = dict(kwargs, target_out=self.features.target_pass(row, target_model,
                                                                          self.model.cfg.target_layer_ids))
            out = self.objective(self.model, target_model, ids, mask, gen, **kwargs)
            if out is not None:
                losses.append(out[0])
                stats.append(out[1])
        if not losses:  # keep every parameter in the graph so DDP still synchronises
            return sum(p.sum() for p in self.model.parameters() if p.requires_grad) * 0.0, []
        return torch.stack(losses).sum() / len(sequences), stats


def _dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed(device: torch.device) -> tuple[int, int]:
    """Join the torchrun process group when launched by torchrun; return (rank, world size)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return _dist_info()


STATE_FILE, STATE_JSON = "train_state.safetensors", "train_state.json"


def save_train_state(path: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int, extra: dict) -> None:
    """Write weights, AdamW moments and the step into one safetensors file (the step and `extra` in its
    metadata), atomically, so a crash leaves the previous state or this one; then a JSON copy of the
    metadata for tools. Temporary files of writers killed earlier are removed."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    opt_steps = {}
    for name, p in model.named_parameters():
        st = opt.state.get(p)
        if st:
            tensors[f"exp_avg.{name}"] = st["exp_avg"].detach().clone().contiguous()
            tensors[f"exp_avg_sq.{name}"] = st["exp_avg_sq"].detach().clone().contiguous()
            opt_steps[name] = float(st["step"])
    meta = json.dumps({"step": step, "opt_steps": opt_steps, **extra})
    for name in (STATE_FILE, STATE_JSON):
        remove_stale_temps(path / name)
    save_safetensors_atomic(path / STATE_FILE, tensors, metadata={"train_state": meta})
    write_text_atomic(path / STATE_JSON, meta)


def has_train_state(path: Path) -> bool:
    """Whether `path` holds a train state to resume from."""
    return (path / STATE_FILE).exists() or (path / STATE_JSON).exists()


def load_train_state(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, float]:
    """Restore a state written by save_train_state; return the step to continue from and the training
    seconds spent before it (steps past the last checkpoint are redone, so their time is not counted).
    A missing, truncated or foreign state raises FileReadError naming the file and the problem."""
    file = path / STATE_FILE
    tensors, metadata = load_safetensors(file, "train state")
    if "train_state" not in metadata:  # written before the step moved into the safetensors metadata
        metadata["train_state"] = json.dumps(read_json(path / STATE_JSON, "train state"))
    try:
        meta = json.loads(metadata["train_state"])
        step, opt_steps, seconds = int(meta["step"]), meta["opt_steps"], float(meta.get("seconds", 0.0))
        model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        for name, p in model.named_parameters():
            if f"exp_avg.{name}" in tensors:
                opt.state[p] = {
                    "step": torch.tensor(opt_steps[name]),
                    "exp_avg": tensors[f"exp_avg.{name}"].to(p.device),
                    "exp_avg_sq": tensors[f"exp_avg_sq.{name}"].to(p.device),
                }
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise FileReadError(f"train state {file} is malformed or does not fit this model: "
                            f"{type(err).__name__}: {err}") from None
    return step, seconds


def _drop_log_rows_after(log_path: Path, step: int) -> dict:
    """Keep only the log rows up to `step` (a run killed between checkpoints logged steps it will redo, and
    maybe half a row); return the last row kept. A malformed complete row raises FileReadError naming it."""
    if not log_path.exists():
        return {}
    rows = read_json_lines(log_path, "training log")
    kept, last = [], {}
    for line, row in rows:
        if row.get("step", 0) <= step:
            kept.append(line)
            last = row
    if "".join(kept) != log_path.read_text(encoding="utf-8"):
        write_text_atomic(log_path, "".join(kept))
    return last


def train(
    model: nn.Module,
    target_model: nn.Module,
    sequences: list[tuple[torch.Tensor, torch.Tensor]],
    objective: Objective,
    cfg: TrainConfig,
    work_dir: str | Path,
    log_path: str | Path | None = None,
    stop_after: int | None = None,
    features: FeatureCache | None = None,
    tensorboard_dir: str | Path | None = None,
) -> dict:
    """Train `model` (the frozen target only provides features/logits); return a summary.

    work_dir keeps the resumable state; a run finding one there continues from it. stop_after ends the
    run early at that step (used to test resumption). `features`: a feature cache of `sequences` that
    replaces the target's forward pass (checked against the target, the data and the drafter's layers).
    `tensorboard_dir`: also write every logged scalar there as TensorBoard events (needs `tensorboard`).
    """
    device = next(model.parameters()).device
    rank, world = init_distributed(device)
    if cfg.batch % world:
        raise ValueError(f"global batch {cfg.batch} is not divisible by the {world} processes")
    for p in target_model.parameters():
        p.requires_grad_(False)
    target_model.eval()
    if features is not None:
        features.check(target_model, sequences, model.cfg.target_layer_ids, autocast_bf16=cfg.bf16)
    work_dir = Path(work_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    step, seconds_before = load_train_state(work_dir, model, opt) if has_train_state(work_dir) else (0, 0.0)
    wrapped: nn.Module = _BatchLoss(model, objective, features)
    if world > 1:
        wrapped = nn.parallel.DistributedDataParallel(wrapped)  # every parameter is in every loss
    batches = global_batches(len(sequences), cfg.batch, cfg.seed)
    for _ in range(step):
        next(batches)
    log, last = None, {}
    if log_path and rank == 0:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        last = _drop_log_rows_after(Path(log_path), step)  # what a run resumed past its end returns
        log = open(log_path, "a", encoding="utf-8")
    board = _tensorboard(tensorboard_dir, step) if tensorboard_dir and rank == 0 else None
    bar = tqdm(total=cfg.steps, initial=step, desc="train", disable=rank != 0, mininterval=5)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16)
    tokens_seen, start = 0, time.perf_counter()
    end = min(cfg.steps, stop_after) if stop_after is not None else cfg.steps
    while step < end:
        idx = next(batches)
        mine = list(range(rank, cfg.batch, world))
        seqs = [sequences[idx[i]] for i in mine]
        gens = [torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * cfg.batch + i) for i in mine]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with autocast:
            loss, stats = wrapped(target_model, seqs, gens, cfg.objective_kwargs, [idx[i] for i in mine])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        step += 1
        tokens_seen += sum(int(s[0].numel()) for s in seqs) * world
        if rank == 0:
            now = time.perf_counter() - start
            last = {"step": step, "lr": opt.param_groups[0]["lr"], "loss": loss.item(), "grad_norm": grad_norm.item(),
                    "tokens_per_s": tokens_seen / now, "elapsed_s": seconds_before + now}
            if stats:
                for key in stats[0]:
                    vals = torch.stack([s[key].float() for s in stats]).nanmean(0)
                    last[key] = vals.tolist() if vals.ndim else float(vals)
            if log:
                log.write(json.dumps(last) + "\n")
                log.flush()
            if board:
                for key, value in last.items():
                    for name, v in ([(key, value)] if not isinstance(value, list) else
                                    [(f"{key}/slot{k + 1}", x) for k, x in enumerate(value)]):
                        if key != "step":
                            board.add_scalar(f"train/{name}", v, step)
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.3f}")
        if step % cfg.ckpt_every == 0 or step == end:
            if rank == 0:
                save_train_state(work_dir, model, opt, step, {"config": asdict(cfg) | {"objective_kwargs": {}},
                                                              "seconds": seconds_before + time.perf_counter() - start})
            if world > 1:
                dist.barrier()
    bar.close()
    if log:
        log.close()
    if board:
        board.close()
    return last


def _tensorboard(log_dir: str | Path, step: int):
    """A SummaryWriter that drops events past `step` left by a killed run, so a resumed curve continues."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError("TensorBoard logging needs the tensorboard package: pip install 'dspark[tensorboard]'") from e
    return SummaryWriter(str(log_dir), purge_step=step + 1 if step else None)
