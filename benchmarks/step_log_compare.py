"""Where does each arm's time per committed token go? (served step logs, `dspark serve --step-log`)

    python benchmarks/step_log_compare.py NAME=STEPS.jsonl[.gz] ... [--min-batch 12]

For each arm's step log, over the steps of at least `--min-batch` running requests: committed tokens per
request-step, drafts verified per request-step, the shares of steps that drafted and that planned, and the
milliseconds per committed token of the whole step and of its parts (drafting call, scheduling, target pass,
the rest of the round: verification, commit and bookkeeping; and the step outside its round: prefill and joins);
then per step: mean rows, the milliseconds of the step (and of it the engine thread's waiting, wall minus CPU
time, in logs that record it) and of its drafting call, scheduling and target pass,
drafts accepted per request-step, and committed tokens per second of the steps and the gaps after them.
"""
from __future__ import annotations

import argparse
import sys

from dspark.engine.steplog import read_step_log


def summary(records: list[dict], min_batch: int) -> str:
    steps = [r for r in records if r["batch"] >= min_batch]
    if not steps:
        return "no steps"
    rows = sum(r["batch"] for r in steps)
    tokens = sum(r["batch"] + r["accepted"] for r in steps)

    def ms(key: str) -> float:
        return 1e3 * sum(r[key] for r in steps) / tokens

    rest = ms("seconds") - ms("draft_seconds") - ms("schedule_seconds") - ms("target_seconds")
    return (f"steps {len(steps)}, tokens/request-step {tokens / rows:.2f}, verified/request-step "
            f"{sum(r['verified'] for r in steps) / rows:.2f}, drafted {sum(r['drafted'] for r in steps) / len(steps):.2f}, "
            f"planned {sum(r['planned'] for r in steps) / len(steps):.2f}; ms per committed token: step "
            f"{ms('step_seconds'):.3f} = drafting {ms('draft_seconds'):.3f} + scheduling {ms('schedule_seconds'):.3f} "
            f"+ target {ms('target_seconds'):.3f} + rest of round {rest:.3f} + outside the round "
            f"{ms('step_seconds') - ms('seconds'):.3f}; {per_step(records, min_batch)}")


def per_step(records: list[dict], min_batch: int) -> str:
    """Means per step over the steps of at least `min_batch` rows, and tokens per second with the gap after each
    (to the next step's start: the engine thread's time outside `step`)."""
    steps = [r for r in records if r["batch"] >= min_batch]
    gaps = [b["started"] - a["started"] - a["step_seconds"] for a, b in zip(records, records[1:])
            if a["batch"] >= min_batch]
    rows = sum(r["batch"] for r in steps)
    tokens = sum(r["batch"] + r["accepted"] for r in steps)

    def ms(key: str) -> float:
        return 1e3 * sum(r[key] for r in steps) / len(steps)

    # logs since the engine recorded its thread's CPU time: the step's time the thread waited instead of computing
    waited = (f", of which waited {ms('step_seconds') - ms('cpu_seconds'):.1f}"
              if all("cpu_seconds" in r for r in steps) else "")
    return (f"per step: rows {rows / len(steps):.1f}, step {ms('step_seconds'):.1f} ms{waited}, drafting "
            f"{ms('draft_seconds'):.1f}, scheduling {ms('schedule_seconds'):.2f}, target {ms('target_seconds'):.1f}; "
            f"accepted/request-step {sum(r['accepted'] for r in steps) / rows:.2f}; tokens/s with gaps "
            f"{tokens / (sum(r['step_seconds'] for r in steps) + sum(gaps)):.0f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", help="NAME=PATH")
    ap.add_argument("--min-batch", type=int, default=12)
    args = ap.parse_args(argv)
    print(f"python benchmarks/step_log_compare.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    for item in args.logs:
        name, _, path = item.partition("=")
        print(f"{name}: {summary(read_step_log(path), args.min_batch)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
