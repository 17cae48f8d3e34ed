"""Time one scheduling decision per policy at R requests × γ drafts (survivals and limits as in a step).

python benchmarks/scheduling_time.py [--requests 256] [--gamma 7] [--reps 200]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from dspark.scheduling import Scheduler, uniform_cost_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cost = uniform_cost_model(gamma=args.gamma, batches=(args.requests,), layout="ragged")
    limits = [args.gamma] * args.requests
    surv = [np.cumprod(rng.uniform(0.4, 1.0, size=(args.requests, args.gamma)), 1) for _ in range(8)]
    print(f"R={args.requests} γ={args.gamma}: median (p90) microseconds per plan over {args.reps} steps")
    for spec in ("fixed", "threshold:0.5", "batch-table", "dspark", "dspark-async"):
        s = Scheduler(spec, args.gamma)
        times = []
        for i in range(args.reps):
            t0 = time.perf_counter()
            s.plan(surv[i % 8], limits, cost, None, range(args.requests))
            times.append((time.perf_counter() - t0) * 1e6)
        times.sort()
        print(f"{spec:<14} {statistics.median(times):8.0f} ({times[int(0.9 * len(times))]:.0f})")


if __name__ == "__main__":
    main()
