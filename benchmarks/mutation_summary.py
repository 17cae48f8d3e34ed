"""Summarise a mutmut run of the lossless core (called by benchmarks/mutation_test.sh).

Reads mutmut's verdicts from mutants/**/*.meta, keeps the mutants matching the scope globs, and writes to --out:
summary.md (per-file and per-function counts, the mutation score, the command, the date, the wall time, and
which survivors README.md does not explain), mutants.txt (every in-scope mutant and its status) and
survivors.diff (each survivor's diff, from `mutmut show`).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import re
import subprocess
from collections import Counter, defaultdict
from pathlib import Path

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout",
          -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", 37: "type check", None: "not checked"}
COLUMNS = ["killed", "timeout", "survived", "no tests", "not checked", "other"]
FILES = ["dspark/verify.py", "dspark/sampling.py", "dspark/scheduling.py", "dspark/engine/engine.py"]


def status_of(code) -> str:
    return STATUS.get(code, "other")


def function_of(name: str) -> str:
    """dspark.engine.engine.xǁEngineǁ_commit__mutmut_3 -> Engine._commit; dspark.verify.x_verify__mutmut_1 -> verify."""
    base = re.sub(r"__mutmut_\d+$", "", name).rpartition(".")[2]
    if base.startswith("xǁ"):
        cls, _, fn = base[2:].partition("ǁ")
        return f"{cls}.{fn}"
    return base[2:]


def score(c: Counter) -> float:
    """mutmut's own score: (killed + timeout) / (mutants tested), as `mutmut badge` computes it."""
    tested = sum(c[k] for k in COLUMNS if k != "not checked")
    return 100.0 * (c["killed"] + c["timeout"]) / tested if tested else 0.0


def row(label: str, c: Counter) -> str:
    total = sum(c.values())
    return f"| {label} | {total} | " + " | ".join(str(c[k]) for k in COLUMNS) + f" | {score(c):.1f}% |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--started", required=True)
    ap.add_argument("--seconds", type=int, required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--children", default="1")
    ap.add_argument("scope", nargs="+")
    args = ap.parse_args()
    out = Path(args.out)

    verdicts: dict[str, dict[str, object]] = {}
    for f in FILES:
        meta = Path("mutants") / (f + ".meta")
        data = json.loads(meta.read_text())
        verdicts[f] = {k: v for k, v in data["exit_code_by_key"].items()
                       if any(fnmatch.fnmatchcase(k, g) for g in args.scope)}

    per_file = {f: Counter(status_of(v) for v in d.values()) for f, d in verdicts.items()}
    per_function: dict[tuple[str, str], Counter] = defaultdict(Counter)
    survivors = []
    lines = []
    for f, d in verdicts.items():
        for k in sorted(d, key=lambda k: (function_of(k), int(k.rpartition("_")[2]))):
            st = status_of(d[k])
            per_function[(f, function_of(k))][st] += 1
            lines.append(f"{k}: {st}")
            if st in ("survived", "no tests", "other"):
                survivors.append(k)
    total = sum(per_file.values(), Counter())
    (out / "mutants.txt").write_text("\n".join(lines) + "\n")

    diffs = []
    for k in survivors:
        shown = subprocess.run(["mutmut", "show", k], capture_output=True, text=True)
        diffs.append(shown.stdout.strip())
    (out / "survivors.diff").write_text("\n\n".join(diffs) + ("\n" if diffs else ""))

    readme = out / "README.md"
    explained = set(re.findall(r"`(dspark\.[^`]+__mutmut_\d+)`", readme.read_text())) if readme.exists() else set()
    unexplained = [k for k in survivors if k not in explained]

    head = "| | mutants | " + " | ".join(COLUMNS) + " | score |"
    sep = "|" + "---|" * (len(COLUMNS) + 3)
    md = [
        "# Mutation testing of the lossless core: run summary",
        "",
        f"- command: `{args.command}` (mutmut 3.8.1, `--max-children {args.children}`)",
        f"- started: {args.started}; wall time of `mutmut run`: {args.seconds // 60} min {args.seconds % 60} s",
        "- score = (killed + timeout) / mutants tested, as `mutmut badge` computes it",
        "",
        "## Per file (in-scope functions only)",
        "",
        head, sep,
        *[row(f, per_file[f]) for f in FILES],
        row("**all**", total),
        "",
        "## Per function",
        "",
        head, sep,
        *[row(f"{f} `{fn}`", c) for (f, fn), c in sorted(per_function.items())],
        "",
        f"Surviving mutants: {len(survivors)}; explained in README.md: {len(survivors) - len(unexplained)}; "
        f"not explained: {len(unexplained)}" + (" (" + ", ".join(unexplained) + ")" if unexplained else ""),
        "",
    ]
    (out / "summary.md").write_text("\n".join(md))


if __name__ == "__main__":
    main()
