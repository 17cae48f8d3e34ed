"""What one more cache slot costs a served target pass, by the pass's width, fitted on the engine's own rounds.

    python benchmarks/context_slope.py --arms none fixed:3 [--concurrency 64] [--temperature 1] [--blocks 3]
        [--min-batch 60] [--profile FILE] [--out FILE]

Each arm serves blocks of held-out requests in process (`interleaved_arms.Arm`, the engine `dspark serve`
runs); every decoding round's target seconds, rows B, query tokens N and cache slots per row S are kept. For the
rounds of at least `--min-batch` rows without a fused prefill chunk, grouped by width w = N / B, it fits
ms(64 rows) = a + b·S by least squares. The pass fit (`dspark.pass_fit`) prices the context as
s·N·S, so it assumes b grows in proportion to w; attention that reads each row's keys and values once for all its
query tokens makes b a cost per row and slot plus a smaller one per query token and slot: b = 64·(r + t·w).
The report gives b per width, r and t where two widths or more were fitted, and the pass fit's own s at the end
of each arm's run, for comparison.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleaved_arms import Arm, make_blocks, write_report  # noqa: E402

from dspark.api import encode_prompt
from dspark.evaluation.bench import load_eval_prompts

REF_ROWS = 64  # the slopes are reported per this many rows (the rounds' seconds scale by B / REF_ROWS)


def fit_slopes(rounds: list[tuple[int, int, float, float]], min_rows: int = 1, min_rounds: int = 5
               ) -> dict[int, tuple[float, float, int]]:
    """Per width w (N // B): (a, b, rounds) of ms(REF_ROWS rows) = a + b·S over `rounds` given as (B, N, S,
    target seconds), keeping rounds of at least `min_rows` rows; widths with fewer than `min_rounds` rounds or a
    single S are left out."""
    by_width: dict[int, list[tuple[float, float]]] = {}
    for rows, tokens, slots, seconds in rounds:
        if rows >= min_rows and rows > 0:
            by_width.setdefault(tokens // rows, []).append((slots, seconds * 1e3 * REF_ROWS / rows))
    out = {}
    for w, pts in sorted(by_width.items()):
        x = np.array([p[0] for p in pts], dtype=np.float64)
        if len(pts) < min_rounds or np.ptp(x) == 0:
            continue
        y = np.array([p[1] for p in pts], dtype=np.float64)
        a, b = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)[0]
        out[w] = (float(a), float(b), len(pts))
    return out


def split_slope(slopes: dict[int, tuple[float, float, int]]) -> tuple[float, float] | None:
    """(r, t) in seconds per row-slot and per query-token-slot from b(w) = REF_ROWS·(r + t·w), least squares over
    the fitted widths weighted by their rounds; None with fewer than two widths."""
    if len(slopes) < 2:
        return None
    w = np.array(list(slopes), dtype=np.float64)
    b = np.array([s[1] for s in slopes.values()]) / 1e3 / REF_ROWS
    weight = np.sqrt(np.array([s[2] for s in slopes.values()], dtype=np.float64))
    r, t = np.linalg.lstsq(np.stack([np.ones_like(w), w], 1) * weight[:, None], b * weight, rcond=None)[0]
    return float(r), float(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", nargs="+", default=["none", "fixed:3"])
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--length-spread", type=float, default=0.5)
    ap.add_argument("--blocks", type=int, default=3, help="blocks of 3 x concurrency requests per arm")
    ap.add_argument("--min-batch", type=int, default=None, help="rows a fitted round has at least "
                                                                "(default: 15/16 of the concurrency)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", default="benchmarks/results/serving/profile_cpu_epyc_v29_1thread.json")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    min_rows = args.min_batch if args.min_batch is not None else max(1, args.concurrency * 15 // 16)
    arms = [Arm(spec, args.drafter, args.concurrency, args.temperature, args.max_tokens, args.profile, True,
                length_spread=args.length_spread) for spec in args.arms]
    prompts = [encode_prompt(arms[0].target, p) for d in ("code", "prose", "math") for p in load_eval_prompts(d, 40)]
    for block in make_blocks(prompts, 3 * args.concurrency, args.blocks):
        for arm in arms:
            arm.serve(block)
    lines = [f"python benchmarks/context_slope.py {' '.join(argv if argv is not None else sys.argv[1:])}",
             f"{args.concurrency} clients, temperature {args.temperature:g}, rounds of >= {min_rows} rows without a "
             f"fused prefill chunk; target ms of {REF_ROWS} rows = a + b * slots per row, by width (query tokens "
             f"per row)"]
    data = {}
    pooled: dict[int, tuple[float, float, int]] = {}  # every arm's widths together, the most rounds per width
    for arm in arms:
        rounds = [(i.batch, i.tokens, i.kv_slots, i.target_seconds) for i in arm.steps if not i.fused_prefill]
        slopes = fit_slopes(rounds, min_rows)
        for w, fit in slopes.items():  # none: width 1, fixed:K: K + 1 mostly
            if w not in pooled or fit[2] > pooled[w][2]:
                pooled[w] = fit
        split = split_slope(slopes)
        fitted = arm.engine.pass_fit.slot_seconds
        for w, (a, b, n) in slopes.items():
            lines.append(f"{arm.spec:10s} width {w}: {n:4d} rounds, a {a:6.2f} ms, b {b:.4f} ms/slot "
                         f"({b / REF_ROWS * 1e3:.3f} us per row-slot)")
        if split is not None:
            lines.append(f"{arm.spec:10s} per row-slot {split[0] * 1e6:.3f} us + per query-token-slot "
                         f"{split[1] * 1e6:.3f} us")
        lines.append(f"{arm.spec:10s} pass fit's slope per query-token-slot: "
                     + ("not fitted" if fitted is None else f"{fitted * 1e6:.3f} us"))
        data[arm.spec] = {"slopes": {str(w): s for w, s in slopes.items()}, "split": split, "pass_fit": fitted}
    split = split_slope(pooled)
    if split is not None:
        lines.append(f"all arms (widths {sorted(pooled)}): per row-slot {split[0] * 1e6:.3f} us + per "
                     f"query-token-slot {split[1] * 1e6:.3f} us")
    data["pooled"] = {"widths": sorted(pooled), "split": split}
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_report(args.out, text, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
