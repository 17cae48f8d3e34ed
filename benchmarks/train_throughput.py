"""Drafter training throughput: sequence tokens/s of `dspark train`'s loop, with and without bf16 autocast.

    python benchmarks/train_throughput.py --data data/regen/all.jsonl [--kind dspark] [--steps 12] [--repeats 2]

Each setting trains a fresh drafter of the bundled recipe (two layers, MLP 480, rank-256 Markov head
for dspark) for `steps` steps of 8 sequences with the real training loop; settings alternate `repeats`
times in one process so that both see the same machine load. Run with OMP_NUM_THREADS=1 to compare
with the cards (one thread per training).
"""
from __future__ import annotations

import argparse
import tempfile

import torch

from dspark.api import load_target
from dspark.training.block_objective import block_drafter_loss
from dspark.training.data import load_sequences
from dspark.training.eagle3_objective import eagle3_loss
from dspark.training.losses import DFLASH_WEIGHTS, DSPARK_WEIGHTS
from dspark.training.recipes import build_drafter
from dspark.training.trainer import TrainConfig, train


def run(kind: str, target, sequences, steps: int, bf16: bool) -> float:
    """Sequence tokens/s of `steps` training steps of a fresh drafter."""
    torch.manual_seed(0)
    model = build_drafter(kind, target, layers=2, markov_rank=256 if kind == "dspark" else 32,
                          intermediate_size=480 if kind != "eagle3" else None)
    kwargs = {} if kind == "eagle3" else {
        "num_anchors": 64, "weights": DFLASH_WEIGHTS if kind == "dflash" else DSPARK_WEIGHTS}
    cfg = TrainConfig(steps=steps, batch=8, lr=1e-3, ckpt_every=10**9, bf16=bf16, objective_kwargs=kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        last = train(model, target.model, sequences, eagle3_loss if kind == "eagle3" else block_drafter_loss,
                     cfg, tmp, log_path=None)
    return float(last["tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True)
    parser.add_argument("--kind", default="dspark", choices=["dflash", "dspark", "dspark-rnn", "eagle3"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    target = load_target(dtype="float32")
    sequences = [s for s in load_sequences(args.data, 768) if int(s[1].sum()) >= 16]
    print(f"command: python benchmarks/train_throughput.py --data {args.data} --kind {args.kind} "
          f"--steps {args.steps} --repeats {args.repeats}  ({torch.get_num_threads()} thread(s))")
    results: dict[str, list[float]] = {"bf16 autocast": [], "float32": []}
    for _ in range(args.repeats):
        results["bf16 autocast"].append(run(args.kind, target, sequences, args.steps, True))
        results["float32"].append(run(args.kind, target, sequences, args.steps, False))
    for name, vals in results.items():
        print(f"{args.kind} {name:14s} sequence tokens/s: " + ", ".join(f"{v:.0f}" for v in vals)
              + f"  (mean {sum(vals) / len(vals):.0f})")


if __name__ == "__main__":
    main()
