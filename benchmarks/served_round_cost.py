"""What a served round of fixed K costs against what the step profile says, per temperature.

    python benchmarks/served_round_cost.py --profile benchmarks/results/serving/profile_cpu_epyc_v19.json
        [--concurrency 16] [--ks 1 3 5 7] [--temperatures 1 0] [--blocks 3] [--out FILE]

For each temperature, one engine per fixed:K arm serves the same blocks of held-out requests in a closed loop
of `--concurrency` running ones (`interleaved_arms.Arm`, the arms taking turns; the first block is warm-up).
Over the rounds that ran the whole batch, verified exactly K drafts per row and carried no prefill chunk, it
reports the median round (drafting call, target pass, the rest: verification, commit, bookkeeping) beside the
profile's cell for that step (B requests, N = B·(1 + K), drafting K slots, without online correction). The
profile is measured greedily; this shows how far sampled rounds depart from it, level and slope.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import interleaved_arms as ia  # noqa: E402

from dspark.api import encode_prompt  # noqa: E402
from dspark.atomic import write_text_atomic  # noqa: E402
from dspark.evaluation.bench import load_eval_prompts  # noqa: E402
from dspark.scheduling import CostModel  # noqa: E402


def measure(profile: str, concurrency: int, ks: list[int], temperature: float, blocks: int) -> list[str]:
    table = CostModel.from_dict(json.loads(Path(profile).read_text())["cost"])
    arms = {k: ia.Arm(f"fixed:{k}", "dspark", concurrency, temperature, 64, profile, True, length_spread=0.5)
            for k in ks}
    target = next(iter(arms.values())).target
    prompts = [encode_prompt(target, p) for d in ("code", "prose", "math") for p in load_eval_prompts(d, 40)]
    for b, block in enumerate(ia.make_blocks(prompts, 2 * concurrency, blocks)):
        order = list(arms.items()) if b % 2 == 0 else list(arms.items())[::-1]
        for _, arm in order:
            if b == 1:
                arm.steps = []
            arm.serve(block)
    lines = []
    for k, arm in arms.items():
        rounds = [i for i in arm.steps if i.drafted and i.batch == concurrency and not i.fused_prefill
                  and max(i.lengths) == k]
        if not rounds:
            lines.append(f"T={temperature:g} K={k}: no full round")
            continue
        ms = statistics.median(i.seconds for i in rounds) * 1e3
        draft = statistics.median(i.draft_seconds for i in rounds) * 1e3
        target_ms = statistics.median(i.target_seconds for i in rounds) * 1e3
        cell = (table.cost(concurrency, concurrency * (1 + k), k) - table.overhead.fixed(concurrency)) * 1e3
        lines.append(f"T={temperature:g} K={k}: {len(rounds):3d} rounds, median {ms:6.1f} ms (drafting {draft:5.1f}, "
                     f"target {target_ms:5.1f}, rest {ms - draft - target_ms:4.1f}); profile {cell:6.1f} ms; "
                     f"ratio {ms / cell:.2f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", required=True)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5, 7])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lines = [f"# python {' '.join(sys.argv)}"]
    for temperature in args.temperatures:
        more = measure(args.profile, args.concurrency, args.ks, temperature, args.blocks)
        print("\n".join(more), flush=True)
        lines += more
    if args.out is not None:
        write_text_atomic(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
