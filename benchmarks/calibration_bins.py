"""Does a different histogram binning lower DSpark's per-domain ECE? Refits the shipped map's bins from the
recorded rounds of `benchmarks/calibrate_zoo.sh` (no decoding) at several bin counts and smoothings.

    python benchmarks/calibration_bins.py [--records data/calibration_records] [--drafter dspark] [--temperature 0]

For each setting: `fit_map` per domain (and pooled) as `dspark calibrate` fits it, with that many equal-mass
bins per position and that smoothing, scored on the held-out rounds (pooled cumulative ECE, 20
bins, per domain with the per-domain maps). The shipped setting is 10 bins, smoothing 2.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dspark.calibration.fit import fit_map
from dspark.calibration.job import records_paths
from dspark.calibration.metrics import calibration_report
from dspark.calibration.records import RoundRecords

SETTINGS = [(10, 2.0), (5, 2.0), (20, 2.0), (10, 20.0), (5, 20.0)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", default="data/calibration_records")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    fit_path, eval_path = records_paths(Path(args.records), args.drafter, args.temperature)
    fit, held = RoundRecords.load(fit_path), RoundRecords.load(eval_path)
    domains = sorted(set(fit.domain))
    parts = {d: fit.subset([x == d for x in fit.domain]) for d in domains}
    has_head = bool(torch.isfinite(fit.signals[..., 0]).any())
    print(f"{args.drafter}, T {args.temperature:g}: {len(fit)} fitted rounds, {len(held)} held-out; "
          "pooled cumulative ECE (%), per-domain maps")
    print(f"{'bins':>5} {'smoothing':>9} " + " ".join(f"{d:>7}" for d in ["all", *domains]))
    for bins, smoothing in SETTINGS:
        maps = {d: fit_map(parts[d], has_head, bins=bins, smoothing=smoothing) for d in domains}
        ece = calibration_report(held, fit_map(fit, has_head, bins=bins, smoothing=smoothing), maps)["headline_ece"]
        print(f"{bins:>5} {smoothing:>9g} " + " ".join(f"{100 * ece[d]:7.2f}" for d in ["all", *domains]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
