"""Served step logs by mode: drafted, plain with the drafter awake, plain with it asleep, per load cell.

    python benchmarks/step_log_modes.py STEPS.jsonl[.gz] [--cells 1 2] [--min-batch 16]

A step log of `dspark serve --step-log` spans every cell a sweep ran on that server; cells are told apart by
the engine's idle gaps between them (over 0.5 s), the first being the sweep's warm-up. Per cell: its wall
time and tokens per second, and for the steps of at least `--min-batch` rows in each mode their tokens per
second of step time, mean rows, step / round / target-pass / drafting milliseconds and the cache's slots per
row (what each row's attention spans).
"""
from __future__ import annotations

import argparse

import numpy as np

from dspark.engine.steplog import read_step_log

MODES = (("drafted", lambda x: x["drafted"]),
         ("plain awake", lambda x: not x["drafted"] and not x["asleep"]),
         ("plain asleep", lambda x: not x["drafted"] and x["asleep"]))


def cells(steps: list[dict], gap: float = 0.5) -> list[list[dict]]:
    """The log split where the engine sat idle for more than `gap` seconds."""
    out, cur = [], [steps[0]]
    for a, b in zip(steps, steps[1:]):
        if b["started"] - (a["started"] + a["step_seconds"]) > gap:
            out.append(cur)
            cur = []
        cur.append(b)
    out.append(cur)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--cells", type=int, nargs="*", default=None, help="cell indices (default: all)")
    ap.add_argument("--min-batch", type=int, default=16)
    args = ap.parse_args()
    split = cells(read_step_log(args.log))
    for i in args.cells if args.cells is not None else range(len(split)):
        m = split[i]
        wall = m[-1]["started"] + m[-1]["step_seconds"] - m[0]["started"]
        tokens = sum(x["batch"] + x["accepted"] for x in m)
        print(f"cell {i}: {len(m)} steps, {wall:.1f} s, {tokens / wall:.0f} tokens/s, up to {max(x['batch'] for x in m)} rows")
        for name, keep in MODES:
            k = [x for x in m if keep(x) and x["batch"] >= args.min_batch]
            if not k:
                continue

            def ms(key: str) -> float:
                return 1e3 * float(np.mean([x[key] or 0.0 for x in k]))

            rate = sum(x["batch"] + x["accepted"] for x in k) / sum(x["step_seconds"] for x in k)
            print(f"  {name:12s} steps {len(k):4d}  {rate:6.0f} tokens/s  rows {np.mean([x['batch'] for x in k]):5.1f}  "
                  f"step {ms('step_seconds'):5.1f}  round {ms('seconds'):5.1f}  target {ms('target_seconds'):5.1f}  "
                  f"draft {ms('draft_seconds'):4.1f} ms  slots/row {np.mean([x['kv_slots'] for x in k]):4.0f}")


if __name__ == "__main__":
    main()
