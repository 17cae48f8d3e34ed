"""Served step logs side by side per batch size: what each arm verified, committed and paid per step.

    python benchmarks/step_log_by_batch.py NAME=STEPS.jsonl[.gz] [NAME=STEPS.jsonl[.gz] ...] [--min-steps 5]

For every batch size and arm, drafted steps without a prefill split into planned (P) and unplanned (U: fixed
policies, and adaptive steps whose plan was skipped): drafts verified and tokens committed per request, the
mean step / round / drafting / target-pass / scheduling milliseconds, the measured round over the cost model's
prediction (adaptive arms) and milliseconds of step per committed token, with the histogram of the step's
longest verified block. Step logs come from `dspark serve --step-log` (in `benchmarks/serve_sweep.py`, an arm
`ARM+step-log=FILE`).
"""
from __future__ import annotations

import argparse

import numpy as np

from dspark.engine.steplog import read_step_log



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", help="NAME=PATH of a step log")
    ap.add_argument("--min-steps", type=int, default=5)
    args = ap.parse_args()
    logs = {}
    for item in args.logs:
        name, sep, path = item.partition("=")
        logs[name if sep else item] = read_step_log(path if sep else item)
    for name, steps in logs.items():
        print(name, len(steps), "steps; batch-size histogram", np.bincount([s["batch"] for s in steps]).tolist())
    top = max(s["batch"] for steps in logs.values() for s in steps)
    for b in range(1, top + 1):
        for name, steps in logs.items():
            for planned in (True, False):
                m = [s for s in steps if s["batch"] == b and s["drafted"] and not s["prefill_tokens"]
                     and bool(s["planned"]) == planned]
                if len(m) < args.min_steps:
                    continue
                rows = sum(s["batch"] for s in m)
                tokens = sum(s["batch"] + s["accepted"] for s in m) / rows

                def ms(key: str) -> float:
                    return 1000 * float(np.mean([s[key] or 0.0 for s in m]))

                priced = [s for s in m if s["predicted_seconds"]]
                ratio = (sum(s["seconds"] for s in priced) / sum(s["predicted_seconds"] for s in priced)
                         if priced else float("nan"))
                print(f"B={b:<3d} {name:10s} {'P' if planned else 'U'} steps {len(m):4d}  verified/req "
                      f"{sum(s['verified'] for s in m) / rows:.2f}  tokens/req {tokens:.2f}  step {ms('step_seconds'):.1f}"
                      f"  round {ms('seconds'):.1f}  draft {ms('draft_seconds'):.1f}  target {ms('target_seconds'):.1f}"
                      f"  sched {ms('schedule_seconds'):.2f}  round/predicted {ratio:.3f}  ms/token "
                      f"{ms('step_seconds') / tokens / b:.2f}  longest {np.bincount([s['max_length'] for s in m]).tolist()}")


if __name__ == "__main__":
    main()
