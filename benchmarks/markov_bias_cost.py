"""Cost of the Markov head's per-slot bias W1[x]·W2ᵀ over a 7-slot block, float32 addmm vs bfloat16 mm.

    python benchmarks/markov_bias_cost.py [--vocab 8192] [--ranks 32 128 256] [--batch 1] [--reps 400]

One thread, the two variants interleaved, median milliseconds per block. This is the sequential part of
DSpark's drafting that grows with the rank r (the paper uses r = 256).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def block_bias_f32(logits: torch.Tensor, w1: torch.Tensor, w2t: torch.Tensor, prev: torch.Tensor, slots: int) -> None:
    for _ in range(slots):
        logits.addmm_(w1[prev], w2t)


def block_bias_bf16(logits: torch.Tensor, w1: torch.Tensor, w2t: torch.Tensor, prev: torch.Tensor, slots: int) -> None:
    for _ in range(slots):
        logits.add_(torch.mm(w1[prev], w2t))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--ranks", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--slots", type=int, default=7)
    parser.add_argument("--reps", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for r in args.ranks:
        w1 = torch.randn(args.vocab, r, generator=g) * 0.02
        w2t = torch.randn(r, args.vocab, generator=g) * 0.02
        arms = {"float32 addmm": (block_bias_f32, w1, w2t), "bfloat16 mm": (block_bias_bf16, w1.bfloat16(), w2t.bfloat16())}
        logits = torch.zeros(args.batch, args.vocab)
        prev = torch.arange(args.batch) + 5
        times: dict[str, list[float]] = {name: [] for name in arms}
        for rep in range(args.reps + 20):
            for name, (fn, a, b) in arms.items():
                t = time.perf_counter()
                fn(logits, a, b, prev, args.slots)
                if rep >= 20:
                    times[name].append(time.perf_counter() - t)
        cells = "   ".join(f"{name} {statistics.median(v) * 1e3:.3f} ms" for name, v in times.items())
        print(f"rank {r:4d}, batch {args.batch}: {cells}")


if __name__ == "__main__":
    main()
