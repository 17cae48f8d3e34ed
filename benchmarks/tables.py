"""Markdown tables of a `dspark bench --json` file, as the README shows them (macro, then per domain).

    python benchmarks/tables.py benchmarks/results/bench.json
"""
from __future__ import annotations

import sys

from dspark.evaluation.bench import load_results


def _se(row: dict) -> str:
    """τ's standard error; older bench files do not have it."""
    return "-" if row.get("tau_se") is None else f"{row['tau_se']:.2f}"


def main() -> None:
    d = load_results(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/bench.json")
    print("| T | drafter | τ | ± se | speedup |\n|---|---|---|---|---|")
    for m in d["macro"]:
        print(f"| {m['temperature']:.1f} | {m['drafter']} | {m['tau']:.2f} | {_se(m)} | {m['speedup']:.2f}x |")
    print()
    print("| domain | T | drafter | τ | ± se | speedup | greedy output identical to target-only | conditional acceptance by position |")
    print("|---|---|---|---|---|---|---|---|")
    for r in d["runs"]:
        if r["drafter"] == "none":
            continue
        same = f"{r['identical_to_target_only']:.2f}" if r["temperature"] == 0 else "n/a"
        ca = [round(x, 2) for x in r["conditional_acceptance"]]
        print(f"| {r['domain']} | {r['temperature']:g} | {r['drafter']} | {r['tau']:.2f} | {_se(r)} | {r['speedup']:.2f}x "
              f"| {same} | {ca} |")


if __name__ == "__main__":
    main()
