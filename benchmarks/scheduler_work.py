"""What the adaptive scheduler's own work costs an engine step, part by part, as `dspark serve` runs it.

    python benchmarks/scheduler_work.py [--concurrency 1 8 32] [--temperatures 0 1] [--steps 200] [--threads N]
        [--out FILE]

Keeps `--concurrency` requests running in process (benchmarks/engine_overhead.py's closed loop) in the
`dspark` engine of benchmarks/interleaved_arms.py (the profiled cost model and online calibration on, as
`dspark serve` has them), and times every call of the four parts a fixed policy does not pay: the block's signals, calibrated survival (the
online calibrator over the offline maps), Algorithm 1's plan, and the online calibrator's observations (its
refits included). Reports milliseconds per step and their share of the step. To compare two versions, run
it from each checkout in turns (PYTHONPATH=checkout) and put the tables side by side.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_overhead import closed_loop  # noqa: E402
from interleaved_arms import Arm  # noqa: E402

import dspark.engine.engine as engine_module  # noqa: E402
from dspark.api import encode_prompt  # noqa: E402
from dspark.calibration import signals as signals_module  # noqa: E402
from dspark.evaluation.bench import load_eval_prompts  # noqa: E402
from dspark.scheduling import Scheduler  # noqa: E402

PARTS = ("signals", "survival", "plan", "online observe")


def timed(seconds: Counter, label: str, fn):
    """fn wrapped to add its wall time to seconds[label]."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - start
    return wrapper


def measure(concurrency: int, temperature: float, steps: int, warmup: int, profile: str | None,
            max_tokens: int) -> dict[str, float]:
    """Milliseconds per step of each part, and of the whole step, over `steps` steps after `warmup`."""
    arm = Arm("dspark", "dspark", concurrency, temperature, max_tokens, profile, online=True)  # as `dspark serve`
    engine, online = arm.engine, arm.engine.online_calibration
    seconds: Counter = Counter()
    patches = [(signals_module, "block_signals", "signals"), (engine_module, "survival_for", "survival"),
               (Scheduler, "plan", "plan"), (online, "observe_step", "online observe")]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, label in patches:
            setattr(obj, name, timed(seconds, label, getattr(obj, name)))
        prompts = [encode_prompt(arm.target, p) for d in ("code", "prose", "math") for p in load_eval_prompts(d, 40)]
        closed_loop(engine, prompts, concurrency, warmup, 1, max_tokens, temperature, False)
        seconds.clear()
        infos = closed_loop(engine, prompts, concurrency, 0, steps, max_tokens, temperature, False)
    finally:
        for obj, name, fn in saved:
            if obj is online:
                del online.observe_step  # back to the class's method
            else:
                setattr(obj, name, fn)
    out = {label: 1e3 * seconds[label] / len(infos) for label in PARTS}
    out["step"] = 1e3 * statistics.mean(i.seconds for i in infos)
    out["drafted"] = statistics.mean(i.drafted for i in infos)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--profile", default="benchmarks/results/serving/profile_cpu_epyc.json")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (a served engine on a CPU runs one fewer than the cores)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    import dspark

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    lines = [f"python benchmarks/scheduler_work.py {' '.join(sys.argv[1:])}",
             f"dspark from {Path(dspark.__file__).resolve().parent.parent}",
             f"{'T':>3} {'clients':>7} {'step ms':>8} {'drafted':>7} "
             + " ".join(f"{p:>15}" for p in PARTS) + f" {'sum':>13}"]
    print("\n".join(lines), flush=True)
    for t in args.temperatures:
        for c in args.concurrency:
            r = measure(c, t, args.steps, args.warmup, args.profile, args.max_tokens)
            total = sum(r[p] for p in PARTS)
            row = (f"{t:>3g} {c:>7} {r['step']:>8.1f} {r['drafted']:>7.0%} "
                   + " ".join(f"{r[p]:>6.3f} ({100 * r[p] / r['step']:>4.1f}%)" for p in PARTS)
                   + f" {total:>5.2f} ({100 * total / r['step']:>4.1f}%)")
            lines.append(row)
            print(row, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
