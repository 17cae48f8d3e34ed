"""One decoding pass over a wide batched cache: Hugging Face's concatenating cache layers against dspark's
in-place ones (`dspark.kv_cache.HeadroomLayer`), side by side in one process.

    python benchmarks/kv_append.py [--rows 64] [--slots 100 300 600] [--repeats 6] [--dtype bfloat16]

For each cache width the two kinds take turns (repeats × 8 one-token passes over `rows` rows of the bundled
target, the median of the last 6 passes per turn); prints the median pass time of each and their ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

import dspark
from dspark.kv_cache import new_cache


def one_turn(target, rows: int, slots: int, in_place: bool, gen: torch.Generator) -> float:
    lm = target.empty_like()
    lm.reset(rows)
    lm.cache = new_cache(target.model.config) if in_place else DynamicCache(config=target.model.config)
    lm.compact_slack = 10**9
    lm.forward([torch.randint(0, target.vocab_size, (slots,), generator=gen).tolist() for _ in range(rows)])
    times = []
    for _ in range(8):
        start = time.perf_counter()
        lm.forward([[5]] * rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--slots", type=int, nargs="+", default=[100, 300, 600])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    target = dspark.load_target(dtype=args.dtype)
    gen = torch.Generator().manual_seed(0)
    print(f"rows {args.rows}, {args.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'slots':>6} {'HF concat ms':>13} {'in place ms':>12} {'ratio':>6}")
    for slots in args.slots:
        runs = {False: [], True: []}
        for _ in range(args.repeats):
            for in_place in (False, True):
                runs[in_place].append(one_turn(target, args.rows, slots, in_place, gen))
        hf, mine = statistics.median(runs[False]), statistics.median(runs[True])
        print(f"{slots:>6} {1e3 * hf:>13.2f} {1e3 * mine:>12.2f} {mine / hf:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
