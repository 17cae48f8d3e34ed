"""Target passes with attention in row segments (`dspark.attention.row_segments`) against one call over every
row, side by side, and what one more kernel call costs.

    python benchmarks/attention_segments.py [--dtype bfloat16] [--threads 1] [--rows 16 64] [--long 400]
        [--short 80] [--queries 1 4] [--reps 9] [--out FILE]

Each cell builds a batch of `rows` rows as a served batch holds them: one row of `long` tokens, the others of
about `short` (spread ±50%), joined one by one so that every row's text ends at the cache's right end
(`CausalLM.extend`), sorted by where they start (as `Engine` sorts them); then times passes of `queries` tokens
per row, segmented and not (alternating, each rolled back), and reports the medians, their ratio and the
pairs each reads. A last line fits one kernel call's cost in row × slot pairs from single-layer calls over
1 to 8 runs of the same pairs (`SEGMENT_CALL_SLOTS`).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dspark.api import load_target  # noqa: E402
from dspark.atomic import write_text_atomic  # noqa: E402
from dspark.attention import segment_cost, unsegmented  # noqa: E402


def build(target, rows: int, long: int, short: int, seed: int = 0):
    """A wrapper of `rows` rows joined one by one (one long, the rest short), sorted by their first slot."""
    rng = random.Random(seed)
    lengths = [long] + [max(4, int(short * rng.uniform(0.5, 1.5))) for _ in range(rows - 1)]
    lm = target.empty_like()
    lm.reset(0)
    for n in lengths:
        one = target.empty_like()
        one.reset(1)
        one.forward([[5 + (n % 7)] * n])
        lm.extend(one)
    first = lm.first_slots().tolist()
    lm.select(sorted(range(rows), key=first.__getitem__))
    return lm


def pass_ms(lm, queries: int, reps: int) -> tuple[float, float]:
    """Median ms of a pass of `queries` tokens per row, segmented and not (alternating, each rolled back)."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(reps + 1):
        for seg in ((True, False) if i % 2 else (False, True)):
            base = lm.lengths.clone()
            start = time.perf_counter()
            if seg:
                lm.forward([[7] * queries] * lm.batch_size)
            else:
                with unsegmented():
                    lm.forward([[7] * queries] * lm.batch_size)
            if i:
                times[seg].append(time.perf_counter() - start)
            lm.truncate(base)
    return statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3


def call_cost(dtype: torch.dtype, reps: int) -> tuple[float, float]:
    """(µs per kernel call, ns per row × slot pair) of one folded layer call (5 heads over 1, one query a row),
    fitted over the same 64 × 400 pairs split into 1, 2, 4 and 8 calls."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(64, 1, 5, 64, generator=gen).to(dtype)
    k, v = (torch.randn(64, 1, 400, 64, generator=gen).to(dtype) for _ in range(2))
    xs, ys = [], []
    for calls in (1, 2, 4, 8):
        step = 64 // calls
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for a in range(0, 64, step):
                F.scaled_dot_product_attention(q[a:a + step], k[a:a + step], v[a:a + step])
            times.append(time.perf_counter() - start)
        xs.append(calls)
        ys.append(statistics.median(times))
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    base = my - slope * mx  # one call's pairs' share at 0 calls ≈ the pairs' cost
    return slope * 1e6, (base / (64 * 400)) * 1e9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--long", type=int, default=400)
    ap.add_argument("--short", type=int, default=80)
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(dtype=args.dtype)
    if not target.packs:
        raise SystemExit("the target does not take dspark's attention function (no packing): nothing to compare")
    lines = [" ".join(["python benchmarks/attention_segments.py", *(argv if argv is not None else sys.argv[1:])]),
             f"bundled target, {args.dtype}, {args.threads} thread(s); one row of {args.long} tokens, the others "
             f"about {args.short}; medians of {args.reps} alternating passes",
             f"{'rows':>5} {'queries':>7} {'pairs one call':>14} {'segmented':>9} {'one call ms':>11} "
             f"{'segmented ms':>12} {'speed-up':>8}"]
    cells = []
    for rows in args.rows:
        lm = build(target, rows, args.long, args.short)
        width = int(lm.valid.shape[1])
        first = lm.first_slots().tolist()
        for queries in args.queries:
            seg, one = pass_ms(lm, queries, args.reps)
            cells.append({"rows": rows, "queries": queries, "pairs": rows * width,
                          "segmented_pairs": segment_cost(first, width), "segmented_ms": seg, "one_call_ms": one})
            lines.append(f"{rows:>5} {queries:>7} {rows * width:>14} {segment_cost(first, width):>9} {one:>11.2f} "
                         f"{seg:>12.2f} {one / seg:>7.2f}x")
            print(lines[-1], flush=True)
    per_call, per_pair = call_cost(target.dtype, args.reps)
    lines.append(f"one kernel call {per_call:.1f} µs, one row × slot pair {per_pair:.1f} ns: a call costs "
                 f"{per_call * 1e3 / per_pair:.0f} pairs")
    report = "\n".join(lines) + "\n"
    if args.out:
        write_text_atomic(Path(args.out), report)
        write_text_atomic(Path(args.out).with_suffix(".json"),
                          json.dumps({"cells": cells, "call_us": per_call, "pair_ns": per_pair}, indent=1))
    print(report)


if __name__ == "__main__":
    main()
