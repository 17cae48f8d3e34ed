"""Target passes with grouped query heads folded (`dspark.attention`) against Hugging Face's path, side by side.

    python benchmarks/attention_fold.py [--dtype bfloat16] [--threads 1] [--rows 1 8 32] [--slots 100 400]
        [--queries 1 8] [--reps 9] [--out FILE]

Each cell builds a cache of `rows` rows spanning `slots` slots (ragged: row r holds slots − 7r mod 50 tokens,
so the pass has a key mask, as served batches do; `even`: every row full, where Hugging Face drops the mask),
then times passes of `queries` tokens per row, alternating folded and unfolded passes (each rolled back), and
reports the medians and their ratio. One layer's attention alone, at the same shapes, is timed too (`attn`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dspark.api import load_target  # noqa: E402
from dspark.atomic import write_text_atomic  # noqa: E402
from dspark.attention import gqa_attention, unfolded  # noqa: E402
from dspark.packed import _attention  # noqa: E402


def pass_ms(lm, rows: int, slots: int, queries: int, ragged: bool, reps: int) -> tuple[float, float]:
    """Median ms of a pass of `queries` tokens per row, folded and unfolded (alternating, each rolled back)."""
    lm.reset(rows)
    lm.forward([[5] * (slots - ((7 * r) % 50 if ragged else 0)) for r in range(rows)])
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(reps + 1):
        for fold in ((True, False) if i % 2 else (False, True)):
            base = lm.lengths.clone()
            start = time.perf_counter()
            if fold:
                lm.forward([[7] * queries] * rows)
            else:
                with unfolded():
                    lm.forward([[7] * queries] * rows)
            if i:  # the first round warms both paths
                times[fold].append(time.perf_counter() - start)
            lm.truncate(base)
    return statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3


def attention_ms(lm, rows: int, slots: int, queries: int, reps: int) -> tuple[float, float]:
    """Median ms of one layer's attention alone at the target's head layout, folded and unfolded (HF's path)."""
    cfg = lm.model.config
    heads, kv, dim = cfg.num_attention_heads, cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or \
        cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, heads, queries, dim, generator=gen).to(lm.dtype)
    k, v = (torch.randn(rows, kv, slots, dim, generator=gen).to(lm.dtype) for _ in range(2))
    mask = torch.rand(rows, 1, queries, slots, generator=gen) > 0.2
    mask[..., -1] = True
    module = lm.model.model.layers[0].self_attn
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(reps + 1):
        for fold in ((True, False) if i % 2 else (False, True)):
            start = time.perf_counter()
            if fold:
                gqa_attention(q, k, v, mask, scale=dim ** -0.5)
            else:
                with unfolded():
                    _attention(module, q, k, v, mask, 0.0, dim ** -0.5)
            if i:
                times[fold].append(time.perf_counter() - start)
    return statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--slots", type=int, nargs="+", default=[100, 400])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load_target(dtype=args.dtype)
    if not lm.packs:
        raise SystemExit("the target does not take dspark's attention function (no packing): nothing to compare")
    cfg = lm.model.config
    lines = [" ".join(["python benchmarks/attention_fold.py", *(argv if argv is not None else sys.argv[1:])]),
             f"bundled target, {args.dtype}, {args.threads} thread(s), {cfg.num_attention_heads} query heads over "
             f"{cfg.num_key_value_heads} key/value head(s); medians of {args.reps} alternating passes",
             f"{'rows':>5} {'slots':>5} {'queries':>7} {'mask':>6} {'folded ms':>9} {'HF ms':>8} {'HF/folded':>9}"]
    cells = []
    for rows in args.rows:
        for slots in args.slots:
            for queries in args.queries:
                for kind in ("ragged", "even", "attn"):
                    if kind == "attn":
                        folded, plain = attention_ms(lm, rows, slots, queries, args.reps)
                    else:
                        folded, plain = pass_ms(lm, rows, slots, queries, kind == "ragged", args.reps)
                    cells.append({"rows": rows, "slots": slots, "queries": queries, "kind": kind,
                                  "folded_ms": folded, "hf_ms": plain})
                    lines.append(f"{rows:>5} {slots:>5} {queries:>7} {kind:>6} {folded:>9.2f} {plain:>8.2f} "
                                 f"{plain / folded:>8.2f}x")
                    print(lines[-1], flush=True)
    report = "\n".join(lines) + "\n"
    if args.out:
        write_text_atomic(Path(args.out), report)
        write_text_atomic(Path(args.out).with_suffix(".json"), json.dumps({"cells": cells}, indent=1))
    else:
        print(report)


if __name__ == "__main__":
    main()
