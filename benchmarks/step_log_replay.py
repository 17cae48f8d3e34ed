"""Replay a served step log through the cost model, to see what it priced a plain round at and why.

    python benchmarks/step_log_replay.py STEPS.jsonl[.gz] --profile PROFILE.json [--batch 64] [--every 10]
        [--from 0] [--to N]

The engine's online correction sees, per round, the batch, the query tokens, the measured seconds less a fused
chunk's share, whether it drafted and its drafted width, and the cache's slots per row; its pass fit sees the
target pass. This feeds a fresh `CostModel` (from the profile the server ran with) and `PassFit` the same
sequence from the log and prints, every `--every` rounds and at every plain round of `--batch` rows or more,
the plain-round price at `--batch` rows the replay gives (which matches the log's `plain_predicted_seconds`
where the server logged it at that batch), the machine-wide level, its reference row and the plain cell's
correction (log of measured over table, the level when last measured, the measurement count then, its
measurements since it was new or stale). A cell whose last measurement is older than `stale_after` moves with
the level since.
"""
from __future__ import annotations

import argparse
from typing import Iterator

from dspark.engine.steplog import read_step_log
from dspark.pass_fit import PassFit, less_chunk
from dspark.scheduling import CostModel


def replay(steps: list[dict], cost: CostModel, batch: int) -> Iterator[dict]:
    """Feed `cost` (and a fresh pass fit) the log's rounds in order; yield, before each round is folded in, the
    plain price at `batch` rows then, the level, the reference row and the plain cell's correction."""
    fit = PassFit()
    key = ("p", cost._plain_key(batch)[0])
    for i, x in enumerate(steps):
        slots = int(round(x["kv_slots"])) if x.get("kv_slots") else None
        cost.set_context(fit.slot_seconds, slots)
        yield {"index": i, "step": x, "price": cost.plain_cost(batch) - cost.overhead.fixed(batch),
               "level": cost._level, "reference": cost._reference, "cell": cost._cells.get(key)}
        measured = x["seconds"]
        if x["fused_prefill"]:
            chunk = x.get("chunk_seconds")
            measured = None if chunk is None else less_chunk(measured, chunk)
        if measured is not None and x.get("predicted_seconds") is not None:
            cost.observe(x["batch"], x["tokens"], measured, x["drafted"], x.get("draft_width"), slots=slots)
        fit.observe(x["target_seconds"], x["batch"], x["tokens"], slots or 0,
                    x["prefill_tokens"] if x["fused_prefill"] else 0, x["fused_prefill"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log")
    ap.add_argument("--profile", required=True, help="the step profile the server ran with")
    ap.add_argument("--batch", type=int, default=64, help="batch size whose plain price is followed")
    ap.add_argument("--every", type=int, default=10, help="print every N rounds (and every plain round)")
    ap.add_argument("--from", dest="start", type=int, default=0)
    ap.add_argument("--to", dest="stop", type=int, default=None)
    args = ap.parse_args(argv)
    from dspark.profiling import load_profile

    steps = read_step_log(args.log)
    cost = load_profile(args.profile).cost
    print(f"{args.log}: {len(steps)} rounds; plain price at {args.batch} rows (replayed / logged, ms), level, "
          f"reference row, plain cell (log correction, level then, count then, runs)")
    stop = len(steps) if args.stop is None else args.stop
    for r in replay(steps, cost, args.batch):
        x, i = r["step"], r["index"]
        if not args.start <= i < stop or not (i % args.every == 0 or (not x["drafted"] and x["batch"] >= args.batch)):
            continue
        logged = x.get("plain_predicted_seconds") if x["batch"] == args.batch else None
        logged = f"{1e3 * logged:.1f}" if logged is not None else "-"
        kind = "drafted" if x["drafted"] else f"plain {1e3 * x['seconds']:.1f} ms"
        print(f"{i:5d} B={x['batch']:3d} {kind:>16}  price {1e3 * r['price']:6.1f} / {logged:>6}  "
              f"level {r['level']:+.3f}  ref {r['reference']}  cell {r['cell']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
