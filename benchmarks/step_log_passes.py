"""Target passes of served step logs, by kind: drafted or plain, with a fused prefill chunk or without.

    python benchmarks/step_log_passes.py STEPS.jsonl[.gz] [...] [--min-batch 56] [--rows 64]

For the steps of at least `--min-batch` rows, per log and kind: how many, the target pass in ms brought to
`--rows` rows (its seconds × rows / B: a pass's cost grows about in proportion to its rows here), the cache's
slots per row, query tokens per row, the fused chunk's prompt tokens and the engine thread's CPU share of the
step. Side by side, logs of different arms say whether one engine's passes of a kind cost more than another's
under the same load (e.g. `dspark`'s plain probes against a plain engine's steps).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from dspark.engine.steplog import read_step_log

KINDS = ((False, False), (False, True), (True, False), (True, True))  # (drafted, fused)


def pass_rows(steps: list[dict], min_batch: int, rows: int = 64) -> list[dict]:
    """One summary per kind (drafted, fused) present among the steps of at least `min_batch` rows."""
    out = []
    for drafted, fused in KINDS:
        sel = [s for s in steps if s["batch"] >= min_batch and bool(s["drafted"]) == drafted
               and bool(s.get("fused_prefill")) == fused]
        if not sel:
            continue
        mean = statistics.mean
        shares = [s["cpu_seconds"] / s["step_seconds"] for s in sel
                  if s.get("cpu_seconds") is not None and s.get("step_seconds")]
        out.append({"drafted": drafted, "fused": fused, "steps": len(sel),
                    "target_ms": mean(s["target_seconds"] * 1e3 * rows / s["batch"] for s in sel),
                    "slots": mean(s["kv_slots"] for s in sel),
                    "tokens_per_row": mean(s["tokens"] / s["batch"] for s in sel),
                    "prompt_tokens": mean(s.get("prefill_tokens", 0) for s in sel),
                    "cpu_share": mean(shares) if shares else None})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--min-batch", type=int, default=56)
    ap.add_argument("--rows", type=int, default=64, help="rows each pass's time is brought to")
    args = ap.parse_args(argv)
    for path in args.logs:
        for r in pass_rows(read_step_log(path), args.min_batch, args.rows):
            cpu = "" if r["cpu_share"] is None else f", CPU {r['cpu_share']:.2f} of the step"
            print(f"{Path(path).name}: {'drafted' if r['drafted'] else 'plain'}, "
                  f"{'fused' if r['fused'] else 'unfused'}: {r['steps']} steps, target {r['target_ms']:.1f} ms per "
                  f"{args.rows} rows, {r['slots']:.0f} slots, {r['tokens_per_row']:.1f} tokens/row, "
                  f"{r['prompt_tokens']:.0f} prompt tokens{cpu}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
