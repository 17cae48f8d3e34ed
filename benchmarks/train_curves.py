"""Compare drafter trainings by their logged per-slot acceptance (c* = 1 − ½‖p_draft − p_target‖₁).

    python benchmarks/train_curves.py data/long2/dspark/train_log.jsonl data/deep/dspark-5x480/train_log.jsonl \
        [--window 200] [--every 1000]

For each log: the mean predicted acceptance per slot over the last `window` steps, then over windows
ending every `every` steps (equal steps, not equal time: runs of different step counts have different
learning-rate schedules), with the training minutes when the log has them.
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
