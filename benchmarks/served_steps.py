"""Where a served step's time goes: measured step costs under HTTP load against the step-cost profile.

    python benchmarks/served_steps.py --profile benchmarks/results/serving/profile_cpu.json \
        [--arms none fixed:7 dspark] [--temperature 1] [--concurrency 16 32] [--requests-per-client 6] [--out DIR]

For each arm and concurrency the script starts `dspark serve --step-log` (same drafter and profile
everywhere), drives it with closed-loop streaming chat clients (the load driver of `serve_sweep.py`) and reads
the server's step log over the steady window (every client decoding). Per arm it reports committed tokens/s,
steps/s, rows and verified drafts per step, and splits the wall time between two step starts into the
decoding round (what the cost model predicts), the prefill chunk, the rest of the step (admission,
bookkeeping) and the gap outside `step` (dispatching outputs, waiting for the interpreter lock while the
event loop streams). It sets each round's measured seconds against the profile's table (no online
correction) and against the engine's corrected prediction, separately for drafted and plain rounds: if
drafted rounds cost more, relative to the table, than plain ones under load, a scheduler trusting the table
drafts where drafting does not pay. Writes DIR/served_steps.json and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_sweep import closed_loop, start_server, stop_server, wait_healthy  # noqa: E402

from dspark.engine.steplog import read_step_log  # noqa: E402
from dspark.evaluation.bench import load_eval_prompts  # noqa: E402
from dspark.profiling import load_profile  # noqa: E402


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def window_figures(steps: list[dict], t0: float, t1: float, table) -> dict:
    """Figures of the steps that started inside [t0, t1] (perf_counter seconds, shared by processes)."""
    inside = [s for s in steps if t0 <= s["started"] <= t1]
    if len(inside) < 3:
        return {"steps": len(inside)}
    span = inside[-1]["started"] - inside[0]["started"]
    periods = [b["started"] - a["started"] for a, b in zip(inside, inside[1:])]
    body = inside[:-1]  # the steps whose whole period lies in the window
    committed = sum(s["batch"] + s["accepted"] for s in body)
    out = {
        "steps": len(inside), "steps_per_s": len(body) / span, "committed_per_s": committed / span,
        "batch": mean([s["batch"] for s in body]), "verified": mean([s["verified"] for s in body]),
        "accepted": mean([s["accepted"] for s in body]),
        "drafted_share": mean([float(s["drafted"]) for s in body]),
        "asleep_share": mean([float(s.get("asleep", False)) for s in body]),
        "blind_rows": mean([s.get("blind", 0) for s in body]),
        "period_ms": 1e3 * mean(periods),
        "round_ms": 1e3 * mean([s["seconds"] for s in body]),
        "prefill_ms": 1e3 * mean([s["prefill_seconds"] for s in body]),
        "rest_ms": 1e3 * mean([s["step_seconds"] - s["seconds"] - s["prefill_seconds"] for s in body]),
        "gap_ms": 1e3 * mean([p - s["step_seconds"] for s, p in zip(body, periods)]),
        "draft_ms": 1e3 * mean([s["draft_seconds"] for s in body]),
        "schedule_ms": 1e3 * mean([s.get("schedule_seconds", 0.0) for s in body]),
        "target_ms": 1e3 * mean([s["target_seconds"] for s in body]),
        "join_ms": 1e3 * mean([s.get("join_seconds", 0.0) for s in body]),
        "kv_slots": mean([s.get("kv_slots", 0) for s in body]),
        "kv_live_per_row": mean([s.get("kv_live", 0) / s["batch"] for s in body]),
    }
    if all("kv_live" in s for s in body):  # slots the attention spans per live token (1: no holes, no uneven rows)
        out["kv_fill"] = sum(s["kv_live"] for s in body) / sum(s["kv_slots"] * s["batch"] for s in body)
    for kind, flag in (("drafted", True), ("plain", False)):
        rows = [s for s in body if s["drafted"] == flag]
        if not rows:
            continue
        tab = [table.cost(s["batch"], s["tokens"]) if flag else table.plain_cost(s["batch"]) for s in rows]
        out[f"{kind}_steps"] = len(rows)
        out[f"{kind}_round_ms"] = 1e3 * mean([s["seconds"] for s in rows])
        out[f"{kind}_target_ms"] = 1e3 * mean([s["target_seconds"] for s in rows])
        out[f"{kind}_table_ms"] = 1e3 * mean(tab)
        out[f"{kind}_over_table"] = mean([s["seconds"] for s in rows]) / mean(tab)
        pred = [s["predicted_seconds"] for s in rows if s["predicted_seconds"] is not None]
        if pred:
            out[f"{kind}_predicted_ms"] = 1e3 * mean(pred)
    return out


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = load_profile(args.profile).cost
    prompts = [p for d in ("code", "prose", "math") for p in load_eval_prompts(d, 40)]
    results = {"command": "python benchmarks/served_steps.py " + " ".join(sys.argv[1:]), "cells": []}
    for conc in args.concurrency:
        for i, arm in enumerate(args.arms):
            name = arm.replace(":", "_")
            log, steps_path = out / f"server_{name}.log", out / f"steps_{name}_c{conc}.jsonl"
            sweep_args = argparse.Namespace(drafter=args.drafter, concurrency=[conc], profile=args.profile,
                                            device="cpu", dtype=args.dtype, max_tokens=args.max_tokens,
                                            length_spread=args.length_spread,
                                            requests_per_client=args.requests_per_client)
            base = f"http://127.0.0.1:{args.port + i}"
            proc = start_server(arm, args.port + i, sweep_args, log, extra=["--step-log", str(steps_path)])
            try:
                wait_healthy(proc, base, 900, log)
                model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
                asyncio.run(closed_loop(base, model, prompts, 2, sweep_args, 0.0, 0))  # warm-up
                clients = asyncio.run(closed_loop(base, model, prompts, conc, sweep_args, args.temperature, 0))
            finally:
                stop_server(proc)
            t0 = max(c[0]["first"] for c in clients)
            t1 = min(c[-1]["end"] for c in clients)
            cell = {"arm": arm, "concurrency": conc, "temperature": args.temperature, "window_s": t1 - t0,
                    "window": [t0, t1], "step_log": str(steps_path),
                    **window_figures(read_step_log(steps_path), t0, t1, table)}
            results["cells"].append(cell)
            print(json.dumps(cell), flush=True)
            (out / "served_steps.json").write_text(json.dumps(results, indent=1))
    return results


def report(results: dict) -> str:
    cols = [("committed_per_s", "tok/s", "{:7.1f}"), ("steps_per_s", "steps/s", "{:6.1f}"),
            ("batch", "rows", "{:5.1f}"), ("verified", "verif", "{:5.1f}"), ("accepted", "acc", "{:5.1f}"),
            ("period_ms", "period", "{:6.1f}"), ("round_ms", "round", "{:6.1f}"), ("prefill_ms", "prefill", "{:6.1f}"),
            ("rest_ms", "rest", "{:5.1f}"), ("gap_ms", "gap", "{:5.1f}"),
            ("drafted_share", "drafted", "{:5.2f}"), ("asleep_share", "asleep", "{:5.2f}"), ("blind_rows", "blind", "{:5.1f}"),
            ("draft_ms", "draft", "{:5.1f}"), ("schedule_ms", "sched", "{:5.2f}"), ("target_ms", "target", "{:5.1f}"),
            ("drafted_over_table", "d/table", "{:6.2f}"), ("plain_over_table", "p/table", "{:6.2f}"),
            ("join_ms", "join", "{:5.2f}"), ("kv_slots", "slots", "{:6.0f}"), ("kv_live_per_row", "live/row", "{:6.0f}"),
            ("kv_fill", "fill", "{:5.2f}")]
    lines = [f"{results['command']}", "times in ms per step; d/table, p/table: measured round / profile table "
             "(drafted, plain rounds)",
             f"{'arm':>10} {'c':>3} " + " ".join(f"{h:>7}" for _, h, _ in cols)]
    for c in results["cells"]:
        vals = [fmt.format(c[k]) if isinstance(c.get(k), (int, float)) else "-" for k, _, fmt in cols]
        lines.append(f"{c['arm']:>10} {c['concurrency']:>3} " + " ".join(f"{v:>7}" for v in vals))
    lines += span_fit(results)
    return "\n".join(lines)


def span_fit(results: dict) -> list[str]:
    """Per concurrency, one least-squares fit over every arm's steady-window rounds: target pass seconds =
    a + b·query tokens + c·(rows × cache slots), the slots the pass's attention spans. What c times each arm's
    mean span gives is the part of its target pass that its cache width costs."""
    import numpy as np

    lines = []
    for conc in sorted({c["concurrency"] for c in results["cells"]}):
        cells = [c for c in results["cells"] if c["concurrency"] == conc and "window" in c]
        rows = []
        missing = [c["arm"] for c in cells if not Path(c["step_log"]).exists()]
        if missing:  # step logs live beside the run (or in /tmp); the JSON alone keeps the table, not this fit
            lines.append(f"c={conc}: no span fit (step logs not found for {', '.join(missing)})")
            continue
        for c in cells:
            t0, t1 = c["window"]
            steps = [s for s in read_step_log(c["step_log"]) if t0 <= s["started"] <= t1 and "kv_slots" in s]
            rows += [(c["arm"], s["tokens"], s["batch"] * s["kv_slots"], s["target_seconds"]) for s in steps]
        if len(rows) < 10:
            continue
        x = np.array([[1.0, r[1], r[2]] for r in rows])
        y = np.array([r[3] for r in rows])
        (a, b, k), *_ = np.linalg.lstsq(x, y, rcond=None)
        lines.append(f"c={conc}: target pass ms = {1e3 * a:.2f} + {1e3 * b:.4f}·tokens + {1e6 * k:.3f}e-3·rows·slots "
                     f"({len(rows)} rounds, every arm)")
        for arm in dict.fromkeys(r[0] for r in rows):
            mine = [r for r in rows if r[0] == arm]
            span = mean([r[2] for r in mine])
            lines.append(f"  {arm:>10}: rows·slots {span:8.0f} -> {1e3 * k * span:6.2f} ms of a "
                         f"{1e3 * mean([r[3] for r in mine]):6.2f} ms target pass")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="step-cost profile (required unless --report)")
    ap.add_argument("--arms", nargs="+", default=["none", "fixed:7", "dspark"])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[16, 32])
    ap.add_argument("--requests-per-client", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--length-spread", type=float, default=0.0, help="as in serve_sweep.py")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--port", type=int, default=8190)
    ap.add_argument("--out", default="benchmarks/results/serving/served_steps")
    ap.add_argument("--report", nargs="?", const="", metavar="JSON",
                    help="only print the table of a results file (default DIR/served_steps.json) and write it "
                         "beside it as .txt")
    args = ap.parse_args()
    if args.report is None and not args.profile:
        ap.error("the following arguments are required: --profile (unless --report)")
    if args.report is not None:
        src = Path(args.report) if args.report else Path(args.out) / "served_steps.json"
        results, dest = json.loads(src.read_text()), src.with_suffix(".txt")
    else:
        results, dest = run(args), Path(args.out) / "served_steps.txt"
    text = report(results)
    print(text)
    dest.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
