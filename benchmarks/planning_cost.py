"""A planned step's own work in process: `decode` with the dspark scheduler, the bundled target and DSpark drafter.

    python benchmarks/planning_cost.py [--batches 1 4 16] [--temperature 1] [--runs 3] [--max-new-tokens 96]
        [--profile benchmarks/results/serving/profile_cpu_epyc_v19.json]

For each batch size, `--runs` decodes of that many held-out prompts (code, prose, math), EOS ignored; over the
steps the scheduler planned, the median `schedule_seconds` (block signals, survival, Algorithm 1 and the
plan's bookkeeping: what a fixed policy does not spend) and the median round. To compare two versions of the
scheduler, run this script on each (e.g. from a `git worktree` of the older commit with PYTHONPATH set to it).
"""
from __future__ import annotations

import argparse
import statistics

from dspark.api import encode_prompt, load_drafter, load_target
from dspark.decoding import decode
from dspark.evaluation.bench import load_eval_prompts
from dspark.profiling import load_profile
from dspark.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--profile", default="benchmarks/results/serving/profile_cpu_epyc_v19.json")
    args = ap.parse_args()
    target = load_target()
    drafter = load_drafter("dspark", target)
    prompts = [encode_prompt(target, p) for d in ("code", "prose", "math") for p in load_eval_prompts(d, 8)]
    for batch in args.batches:
        cost = load_profile(args.profile).cost
        steps = []
        for _ in range(args.runs):
            decode(target, drafter, prompts[:batch], SamplingParams(temperature=args.temperature, seed=1),
                   max_new_tokens=args.max_new_tokens, scheduler="dspark", cost_model=cost, on_step=steps.append,
                   eos_token_ids=frozenset())
        planned = [s for s in steps if s.planned]
        if not planned:
            print(f"B={batch}: no planned step in {len(steps)}")
            continue
        print(f"B={batch}: {len(planned)} planned of {len(steps)} steps, own work (schedule_seconds) median "
              f"{1e3 * statistics.median(s.schedule_seconds for s in planned):.3f} ms, round median "
              f"{1e3 * statistics.median(s.seconds for s in planned):.1f} ms")


if __name__ == "__main__":
    main()
