"""Macro τ of each drafter relative to a reference drafter, with 95% paired bootstrap intervals.

Reads a `dspark bench --json` file (which records tokens and rounds per prompt) and, per temperature,
prints macro τ ± its standard error and the ratio to the reference:

    python benchmarks/compare_tau.py benchmarks/results/t1_precision/bench.json --reference eagle3
"""
from __future__ import annotations

import argparse

from dspark.evaluation.bench import load_results
from dspark.evaluation.metrics import macro_tau, paired_tau_ratio


def per_domain(runs: list[dict], temperature: float, drafter: str) -> dict[str, tuple[list[int], list[int]]]:
    """(tokens per prompt, rounds per prompt) per domain of one drafter at one temperature."""
    rows = [r for r in runs if r["temperature"] == temperature and r["drafter"] == drafter]
    if rows and "prompt_tokens" not in rows[0]:
        raise SystemExit("this bench JSON has no per-prompt counts; rerun `dspark bench --json` with this version")
    return {r["domain"]: (r["prompt_tokens"], r["prompt_rounds"]) for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json")
    ap.add_argument("--reference", required=True, help="drafter the others are divided by, e.g. eagle3")
    ap.add_argument("--draws", type=int, default=2000)
    args = ap.parse_args()
    d = load_results(args.bench_json)
    se = {(m["temperature"], m["drafter"]): m.get("tau_se") for m in d["macro"]}
    for temp in sorted({r["temperature"] for r in d["runs"]}):
        ref = per_domain(d["runs"], temp, args.reference)
        if not ref:
            raise SystemExit(f"no runs of {args.reference!r} at temperature {temp} in {args.bench_json}")
        print(f"\n| T {temp:g} drafter | macro τ | ± se | vs {args.reference} | 95% interval |\n|---|---|---|---|---|")
        for name in dict.fromkeys(r["drafter"] for r in d["runs"] if r["temperature"] == temp):
            if name == "none":
                continue
            runs = per_domain(d["runs"], temp, name)
            ratio, lo, hi = paired_tau_ratio(runs, ref, draws=args.draws)
            s = se.get((temp, name))
            print(f"| {name} | {macro_tau(runs):.2f} | {'-' if s is None else f'{s:.2f}'} | {ratio - 1:+.1%} "
                  f"| {lo - 1:+.1%} .. {hi - 1:+.1%} |")


if __name__ == "__main__":
    main()
