"""Cost of one forward of a model over q new tokens with a 256-token KV cache, fp32 and bf16.

    python benchmarks/forward_cost.py zoo/target zoo/draft-model

Prints a markdown table of median milliseconds and T(q)/T(1); models are timed in alternation.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark.api import load_causal_lm


def time_forward(lm, q: int, context: int, reps: int) -> float:
    """Median seconds of one forward over q new tokens after a `context`-token prefill."""
    times = []
    for _ in range(reps):
        lm.reset(1)
        lm.forward([list(range(1, context + 1))])
        start = time.perf_counter()
        lm.forward([list(range(1, q + 1))])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--qs", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    print(f"command: python benchmarks/forward_cost.py {' '.join(args.models)}; {torch.get_num_threads()} threads\n")
    print("| model | dtype | " + " | ".join(f"q={q}" for q in args.qs) + " |")
    print("|---|---|" + "---|" * len(args.qs))
    for dtype in ("float32", "bfloat16"):
        lms = {m: load_causal_lm(m, dtype) for m in args.models}
        for lm in lms.values():
            time_forward(lm, 1, args.context, 2)
        rows = {m: {} for m in args.models}
        for q in args.qs:
            for m, lm in lms.items():
                rows[m][q] = time_forward(lm, q, args.context, args.reps) * 1000
        for m in args.models:
            base = rows[m][args.qs[0]]
            cells = [f"{rows[m][q]:.2f}" + ("" if q == args.qs[0] else f" ({rows[m][q] / base:.2f})") for q in args.qs]
            print(f"| {m} | {dtype} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
