"""Where a served step's time goes, arm against arm, from `dspark serve --step-log` files.

    python benchmarks/step_log_compare.py LOG [LOG ...] [--min-rows 6]

For the steps with at least `--min-rows` running rows: steps, mean rows, mean step / round / target pass /
drafting / scheduling / prefill milliseconds, the gap to the next step, drafts verified and accepted per row,
and committed tokens per second of step plus gap. Two arms' logs of the same load say which part of a step
one arm pays more for, and what it gets for it.
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path


def read_log(path: Path) -> list[dict]:
    """The step records of a step log (plain or gzipped JSON lines)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(steps: list[dict], min_rows: int) -> dict[str, float]:
    """Means over the steps with at least `min_rows` rows (gaps: to the next step's start)."""
    full = [s for s in steps if s["batch"] >= min_rows]
    if not full:
        raise ValueError(f"no step has {min_rows} rows or more")
    gaps = [b["started"] - a["started"] - a["step_seconds"] for a, b in zip(steps, steps[1:]) if a["batch"] >= min_rows]
    rows = sum(s["batch"] for s in full)
    committed = sum(s["batch"] + s["accepted"] for s in full)
    ms = lambda key: 1e3 * statistics.mean(s[key] for s in full)  # noqa: E731
    return {"steps": len(full), "rows": rows / len(full), "step_ms": ms("step_seconds"), "round_ms": ms("seconds"),
            "target_ms": ms("target_seconds"), "draft_ms": ms("draft_seconds"), "schedule_ms": ms("schedule_seconds"),
            "prefill_ms": ms("prefill_seconds"), "gap_ms": 1e3 * statistics.mean(gaps) if gaps else 0.0,
            "verified_per_row": sum(s["verified"] for s in full) / rows,
            "accepted_per_row": sum(s["accepted"] for s in full) / rows,
            "tokens_per_s": committed / (sum(s["step_seconds"] for s in full) + sum(gaps))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--min-rows", type=int, default=6)
    args = ap.parse_args(argv)
    print(f"{'log':<24} {'steps':>5} {'rows':>5} {'step':>6} {'round':>6} {'target':>6} {'draft':>6} {'sched':>6} "
          f"{'prefill':>7} {'gap':>5} {'verif/row':>9} {'acc/row':>7} {'tok/s':>6}   (ms)")
    for path in args.logs:
        m = summarize(read_log(path), args.min_rows)
        print(f"{path.name:<24} {m['steps']:>5} {m['rows']:>5.1f} {m['step_ms']:>6.1f} {m['round_ms']:>6.1f} "
              f"{m['target_ms']:>6.1f} {m['draft_ms']:>6.1f} {m['schedule_ms']:>6.2f} {m['prefill_ms']:>7.1f} "
              f"{m['gap_ms']:>5.1f} {m['verified_per_row']:>9.2f} {m['accepted_per_row']:>7.2f} "
              f"{m['tokens_per_s']:>6.0f}")


if __name__ == "__main__":
    main()
