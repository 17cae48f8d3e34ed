"""Where does each arm's time per committed token go? (served step logs, `dspark serve --step-log`)

    python benchmarks/step_log_compare.py NAME=STEPS.jsonl[.gz] ... [--min-batch 12]

For each arm's step log, over the steps of at least `--min-batch` running requests: committed tokens per
request-step, drafts verified per request-step, the shares of steps that drafted and that planned, and the
milliseconds per committed token of the whole step and of its parts (drafting call, scheduling, target pass,
the rest of the round: verification, commit and bookkeeping; and the step outside its round: prefill and joins).
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
            f"{ms('step_seconds') - ms('seconds'):.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", help="NAME=PATH")
    ap.add_argument("--min-batch", type=int, default=12)
    args = ap.parse_args()
    print(f"python benchmarks/step_log_compare.py {' '.join(sys.argv[1:])}")
    for item in args.logs:
        name, _, path = item.partition("=")
        print(f"{name}: {summary(read_step_log(path), args.min_batch)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
