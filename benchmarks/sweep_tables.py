"""Markdown tables of a `serve_sweep.py` result, as docs/serving.md and the README show them.

    python benchmarks/sweep_tables.py benchmarks/results/serving/epyc_v9/serve_sweep.json

Per temperature: output tokens/s per arm and concurrency (mean of the repeats ± half their range), then the
adaptive arms' throughput relative to the best other arm and to no speculation, and fixed K = 7 relative to no
speculation (ratios of the repeat means).
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

ADAPTIVE = ("dspark", "dspark-async")


def cell_means(cells: list[dict]) -> dict[tuple[float, str, int], tuple[float, float]]:
    """(temperature, arm, concurrency) -> (mean throughput over repeats, half the repeats' range)."""
    runs: dict[tuple[float, str, int], list[float]] = defaultdict(list)
    for c in cells:
        runs[(c["temperature"], c["arm"], c["concurrency"])].append(c["throughput"])
    return {k: (statistics.fmean(v), (max(v) - min(v)) / 2) for k, v in runs.items()}


def tables(result: dict) -> str:
    means = cell_means(result["cells"])
    temps = sorted({k[0] for k in means}, reverse=True)
    arms = list(dict.fromkeys(k[1] for k in means))
    concs = sorted({k[2] for k in means})
    out = []
    for t in temps:
        out.append(f"Temperature {t:g}, output tokens/s (mean of repeats ± half their range)\n")
        out.append("| arm | " + " | ".join(f"c={c}" for c in concs) + " |")
        out.append("|---" * (len(concs) + 1) + "|")
        for arm in arms:
            vals = [means.get((t, arm, c)) for c in concs]
            name = f"`{arm}`" if arm in ADAPTIVE else arm
            out.append(f"| {name} | " + " | ".join("-" if v is None else f"{v[0]:.1f} ± {v[1]:.1f}" for v in vals)
                       + " |")
        out.append("")
        out.append(f"Temperature {t:g}, ratios of the repeat means")
        out.append("")
        out.append("| ratio | " + " | ".join(f"c={c}" for c in concs) + " |")
        out.append("|---" * (len(concs) + 1) + "|")
        for arm in (a for a in ADAPTIVE if a in arms):
            best, over_none = [], []
            for c in concs:
                others = [(means[(t, a, c)][0], a) for a in arms if a not in ADAPTIVE and (t, a, c) in means]
                top, top_arm = max(others)
                best.append(f"{means[(t, arm, c)][0] / top:.2f}× ({top_arm})")
                none = means.get((t, "none", c))
                over_none.append("-" if none is None else f"{means[(t, arm, c)][0] / none[0]:.2f}×")
            out.append(f"| `{arm}` / best other arm | " + " | ".join(best) + " |")
            if "none" in arms:  # a sweep without the no-speculation arm has no ratios to it
                out.append(f"| `{arm}` / none | " + " | ".join(over_none) + " |")
        if "fixed:7" in arms and "none" in arms:
            out.append("| fixed:7 / none | " + " | ".join(
                f"{means[(t, 'fixed:7', c)][0] / means[(t, 'none', c)][0]:.2f}×" for c in concs) + " |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/serving/epyc_v9/serve_sweep.json"
    with open(path, encoding="utf-8") as f:
        print(tables(json.load(f)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
