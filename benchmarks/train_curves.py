"""Compare drafter trainings by their logged per-slot acceptance (c* = 1 − ½‖p_draft − p_target‖₁).

    python benchmarks/train_curves.py data/long2/dspark/train_log.jsonl data/deep/dspark-5x480/train_log.jsonl \
        [--window 200] [--every 1000]

For each log: the mean predicted acceptance per slot over the last `window` steps, then over windows
ending every `every` steps (equal steps, not equal time: runs of different step counts have different
learning-rate schedules), with the training minutes when the log has them.

`--paired`: runs with the same data, seed and batch draw the same batches, so the difference to the
first log at the steps both logged cancels most of the batch-to-batch noise; reported per window
(mean over the slots and per slot), with the correlation of the slot-1 acceptance of the two runs over
those steps (near 1 when the batches really are the same).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_log(path: Path) -> list[dict]:
    """The entries of a train_log.jsonl that carry per-slot acceptance."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("accept_rate")]


def window_mean(rows: list[dict]) -> list[float]:
    """Per-slot mean of accept_rate over the given entries."""
    slots = len(rows[0]["accept_rate"])
    return [sum(r["accept_rate"][i] for r in rows) / len(rows) for i in range(slots)]


def fmt(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--window", type=int, default=200, help="steps averaged")
    parser.add_argument("--every", type=int, default=1000, help="also report windows ending at multiples of this step")
    parser.add_argument("--paired", action="store_true", help="differences to the first log at shared steps")
    args = parser.parse_args()
    if args.paired:
        paired(args.logs, args.window, args.every)
        return
    for path in args.logs:
        rows = read_log(path)
        if not rows:
            print(f"{path}: no acceptance logged")
            continue
        last = rows[-1]
        minutes = f", {last['elapsed_s'] / 60:.1f} min" if "elapsed_s" in last else ""
        print(f"{path}: {last['step']} steps{minutes}")
        print(f"  last {args.window} steps: {fmt(window_mean(rows[-args.window:]))}")
        for end in range(args.every, last["step"] + 1, args.every):
            span = [r for r in rows if end - args.window < r["step"] <= end]
            if span:
                print(f"  steps {end - args.window + 1}-{end}: {fmt(window_mean(span))}")


def paired(paths: list[Path], window: int, every: int) -> None:
    """Per-slot acceptance differences of each log to the first one, at the steps both logged."""
    base = {r["step"]: r["accept_rate"] for r in read_log(paths[0])}
    for path in paths[1:]:
        rows = [r for r in read_log(path) if r["step"] in base]
        if len(rows) < 2:
            print(f"{path}: fewer than 2 steps shared with {paths[0]}")
            continue
        a = [base[r["step"]][0] for r in rows]
        b = [r["accept_rate"][0] for r in rows]
        ma, mb = sum(a) / len(a), sum(b) / len(b)
        cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
        var = (sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b)) ** 0.5
        print(f"{path} minus {paths[0]}: {len(rows)} shared steps up to {rows[-1]['step']}; "
              f"slot-1 correlation {cov / var:.2f}")
        for end in list(range(every, rows[-1]["step"] + 1, every)) + [rows[-1]["step"]]:
            span = [r for r in rows if end - window < r["step"] <= end]
            if not span:
                continue
            diff = [[r["accept_rate"][i] - base[r["step"]][i] for i in range(len(r["accept_rate"]))] for r in span]
            per = [sum(d[i] for d in diff) / len(diff) for i in range(len(diff[0]))]
            print(f"  steps {span[0]['step']}-{span[-1]['step']} ({len(span)} shared): mean {sum(per) / len(per):+.3f}; "
                  + " ".join(f"{v:+.3f}" for v in per))


if __name__ == "__main__":
    main()
