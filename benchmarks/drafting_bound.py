"""How much any verification policy can gain over no speculation at each batch size, from a step-cost profile and
a drafter's measured survival: Algorithm 1's best expected throughput over plain decoding.

    python benchmarks/drafting_bound.py --profile benchmarks/results/serving/profile_cpu_epyc_v11.json
        --bench benchmarks/results/main60/bench.json --drafter dspark --temperature 1 [--batches 1 4 16 64]

Per batch size B it prints the cost of a drafted step that verifies nothing over a plain step (the drafter's
call and the wider pass: what drafting pays before any draft is accepted) and the best Θ over plain decoding
(Θ = expected committed tokens per second) for two batches: every row with the macro survival row (the
mean over the bench's domains), and rows split evenly over the domains, each with its own survival, in the
padded layout this engine verifies in and on the same costs read as ragged (B + Σℓ tokens, what a flattened
verify pass would price). Where the best Θ is below 1 no policy that drafts for every row can beat no
speculation at that load: the figure bounds the adaptive arm from above, given the survivals.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from dspark.profiling import load_profile
from dspark.scheduling import CostModel, prefix_schedule


def load_cost(path: str, layout: str) -> CostModel:
    """The profile's step-cost table (`dspark profile` output) priced in the given layout."""
    cost = load_profile(path).cost
    return CostModel(cost.drafted, cost.plain, layout)


def survival_rows(bench: str, drafter: str, temperature: float) -> dict[str, np.ndarray]:
    """Each domain's cumulative per-position survival of `drafter` at `temperature` from a `dspark bench --json`."""
    with open(bench, encoding="utf-8") as f:
        runs = json.load(f)["runs"]
    rows = {r["domain"]: np.array(r["cumulative_acceptance"], dtype=np.float64) for r in runs
            if r["drafter"] == drafter and r["temperature"] == temperature and r["cumulative_acceptance"]}
    if not rows:
        raise SystemExit(f"{bench}: no survival for drafter {drafter!r} at temperature {temperature:g}")
    return rows


def best_gain(rows: np.ndarray, cost: CostModel) -> float:
    """Algorithm 1's expected throughput for survival rows [B, γ] over plain decoding of B requests."""
    batch = len(rows)
    _, theta = prefix_schedule(rows, [rows.shape[1]] * batch, cost)
    return theta * cost.plain_cost(batch) / batch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    args = ap.parse_args()
    padded, ragged = load_cost(args.profile, "padded"), load_cost(args.profile, "ragged")
    domains = survival_rows(args.bench, args.drafter, args.temperature)
    macro = np.mean(list(domains.values()), axis=0)
    print(f"python benchmarks/drafting_bound.py {' '.join(sys.argv[1:])}")
    print(f"{args.drafter} at temperature {args.temperature:g}: macro survival "
          + ", ".join(f"{x:.2f}" for x in macro) + f" (τ at full blocks {1 + macro.sum():.2f})")
    print(f"{'B':>4} {'drafted step, no drafts / plain':>32} {'best Θ / plain: macro rows':>28} "
          f"{'domain rows, padded':>20} {'domain rows, ragged':>20}")
    for b in args.batches:
        uniform = np.tile(macro, (b, 1))
        mixed = np.stack([list(domains.values())[r % len(domains)] for r in range(b)])
        print(f"{b:>4} {padded.cost(b, b) / padded.plain_cost(b):>32.2f} {best_gain(uniform, padded):>28.3f} "
              f"{best_gain(mixed, padded):>20.3f} {best_gain(mixed, ragged):>20.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
