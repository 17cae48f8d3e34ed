"""How well the cost model predicted served rounds: measured over predicted, per step kind, batch size and fusion.

    python benchmarks/step_log_accuracy.py STEPS.jsonl[.gz] [STEPS.jsonl[.gz] ...] [--min-steps 5]

For every round of a step log (`dspark serve --step-log`) that the cost model priced, the log of its measured
seconds over the prediction made before it ran, by drafted / plain, batch bucket and whether a prefill chunk
rode in its pass: mean (the bias) and root mean square. A fused round is read less its chunk's share: the one
the engine logged (`chunk_seconds`), or, for a log of an engine that did not fit one (`--no-pass-fit`), the
share a `PassFit` fed with the log's passes up to that round gives, so that logs of both are compared alike.
"""
from __future__ import annotations

import argparse
import math

import numpy as np

from dspark.engine.steplog import read_step_log
from dspark.pass_fit import PassFit, less_chunk

BUCKETS = ((1, 8), (8, 24), (24, 40), (40, 65), (65, 1 << 20))


def log_ratios(steps: list[dict]) -> list[tuple[int, bool, bool, float]]:
    """(batch, drafted, fused, log(measured / predicted)) of every priced round whose chunk share is known."""
    fit, out = PassFit(), []
    for x in steps:
        fused = bool(x["fused_prefill"])
        chunk = x.get("chunk_seconds")
        if fused and chunk is None:
            chunk = fit.chunk_seconds(x["prefill_tokens"])
        fit.observe(x["target_seconds"], x["batch"], x["tokens"], x["kv_slots"], x["prefill_tokens"] if fused else 0,
                    fused)
        if not x["predicted_seconds"] or (fused and chunk is None):
            continue
        measured = less_chunk(x["seconds"], chunk) if fused else x["seconds"]
        out.append((x["batch"], bool(x["drafted"]), fused, math.log(measured / x["predicted_seconds"])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--min-steps", type=int, default=5)
    args = ap.parse_args()
    for path in args.logs:
        rows = log_ratios(read_step_log(path))
        print(path)
        for drafted in (True, False):
            for lo, hi in BUCKETS:
                for fused in (False, True):
                    v = [r for b, d, f, r in rows if d == drafted and f == fused and lo <= b < hi]
                    if len(v) < args.min_steps:
                        continue
                    print(f"  {'drafted' if drafted else 'plain  '} B[{lo},{hi}) {'fused  ' if fused else 'unfused'} "
                          f"rounds {len(v):5d}  mean log(measured/predicted) {np.mean(v):+.3f}  "
                          f"rms {math.sqrt(float(np.mean(np.square(v)))):.3f}")


if __name__ == "__main__":
    main()
