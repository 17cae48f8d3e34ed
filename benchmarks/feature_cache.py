"""Drafter training with target features cached on disk vs computed on the fly, side by side.

    python benchmarks/feature_cache.py --data data/regen/all.jsonl [--rows 400] [--steps 20] [--reps 3]

Builds a feature cache of the first `--rows` training sequences (bf16, as `dspark train --feature-cache`
does), then trains fresh drafters of each kind (bundled recipe: 2 layers, MLP 480, rank 256 for the
block drafters) for `--steps` steps with and without the cache, alternating the order each repetition.
Reports sequence tokens/s (median over repetitions), the speed-up, whether the two runs logged the same
losses (they must), the cache's size per token, and after how many epochs its build time is paid back.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dspark.api import load_target
from dspark.training.block_objective import block_drafter_loss
from dspark.training.data import training_sequences
from dspark.training.eagle3_objective import eagle3_loss
from dspark.training.feature_cache import build_feature_cache
from dspark.training.losses import DFLASH_WEIGHTS, DSPARK_WEIGHTS
from dspark.training.recipes import build_drafter
from dspark.training.trainer import TrainConfig, train


def _run(kind: str, target, seqs, steps: int, cache, work: Path) -> tuple[float, list[float]]:
    torch.manual_seed(42)
    model = build_drafter(kind, target, layers=2, markov_rank=256, intermediate_size=480 if kind != "eagle3" else None)
    if kind == "eagle3":
        objective, kwargs = eagle3_loss, {}
    else:
        objective = block_drafter_loss
        kwargs = {"num_anchors": 64, "weights": DFLASH_WEIGHTS if kind == "dflash" else DSPARK_WEIGHTS}
    cfg = TrainConfig(steps=steps, batch=8, lr=1e-3, ckpt_every=10**9, objective_kwargs=kwargs)
    shutil.rmtree(work, ignore_errors=True)
    train(model, target.model, seqs, objective, cfg, work / "state", log_path=work / "log.jsonl", features=cache)
    log = [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines()]
    return log[-1]["tokens_per_s"], [r["loss"] for r in log]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/regen/all.jsonl")
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--kinds", nargs="+", default=["dspark", "eagle3"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default=None, help="cache folder (default: a temporary one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(None, "float32")
    seqs = training_sequences(args.data)[: args.rows]
    tokens = sum(int(s[0].numel()) for s in seqs)
    tmp = Path(tempfile.mkdtemp(prefix="fcache_"))
    cache_dir = Path(args.cache) if args.cache else tmp / "cache"
    layer_ids = build_drafter("dspark", target, layers=1).cfg.target_layer_ids
    t0 = time.perf_counter()
    cache = build_feature_cache(target.model, seqs, layer_ids, cache_dir)
    build_s = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in cache_dir.glob("shard-*.safetensors"))
    print(f"cache: {len(seqs)} sequences, {tokens} tokens, built in {build_s:.1f} s ({tokens / build_s:.0f} tokens/s), "
          f"{size / tokens / 1024:.2f} KiB per token ({size / 2**20:.0f} MiB); {args.threads} thread(s)")
    print("| drafter | on the fly, tokens/s | cached, tokens/s | speed-up | same losses |")
    print("|---|---|---|---|---|")
    for kind in args.kinds:
        speeds: dict[str, list[float]] = {"fly": [], "cache": []}
        losses: dict[str, list[float]] = {}
        for rep in range(args.reps):
            for mode in (("fly", "cache") if rep % 2 == 0 else ("cache", "fly")):
                tps, loss = _run(kind, target, seqs, args.steps, cache if mode == "cache" else None,
                                 tmp / f"run_{mode}")
                speeds[mode].append(tps)
                losses[mode] = loss
        fly, cached = statistics.median(speeds["fly"]), statistics.median(speeds["cache"])
        same = "yes" if losses["fly"] == losses["cache"] else "NO"
        print(f"| {kind} | {fly:.0f} | {cached:.0f} | {cached / fly:.2f}x | {same} |", flush=True)
        saved = tokens / fly - tokens / cached  # seconds saved per epoch over these sequences
        if saved > 0:
            print(f"  {kind}: an epoch takes {tokens / fly:.0f} s on the fly, {tokens / cached:.0f} s cached; "
                  f"the cache's build pays for itself after {build_s / saved:.1f} epochs")
    if not args.cache:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
