"""What each mode of an adaptive engine costs outside its rounds: a back-off forced at a full batch (in process).

    python benchmarks/forced_backoff.py [--concurrency 64] [--temperature 1] [--warmup 60] [--backoff 100]
        [--steps 150] [--profile FILE] [--out FILE]

Keeps `--concurrency` requests running under `dspark` (online calibration on, as `dspark serve` runs it; each
request asks for 100-299 tokens), then after `--warmup` steps puts the scheduler into a back-off of `--backoff`
steps as a probe that found no gain would (the drafter sleeps while more than `wake_lead` steps are left, then
wakes and keeps its context up to date until the probe), and steps `--steps` more times. Reports, per mode
(asleep, awake and not drafting, drafting), the steps' median round and time outside the round (prefill and
join, row reorders, garbage collection, bookkeeping), and lists every step that spent over 50 ms outside its
round. Served at 64 clients some awake plain steps took about 300 ms outside their round (stop 52); this runs the
same sequence without HTTP beside it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleaved_arms import Arm  # noqa: E402

from dspark.api import encode_prompt  # noqa: E402
from dspark.engine import Request, StepInfo  # noqa: E402
from dspark.evaluation.bench import load_eval_prompts  # noqa: E402
from dspark.host_memory import retain_freed_memory  # noqa: E402
from dspark.sampling import SamplingParams  # noqa: E402

PROFILE = Path(__file__).resolve().parent / "results" / "serving" / "profile_cpu_xeon_v40_1thread.json"


def mode(info: StepInfo) -> str:
    return "drafting" if info.drafted else "asleep" if info.asleep else "awake, plain"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--backoff", type=int, default=100)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--profile", default=str(PROFILE))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    retain_freed_memory()
    torch.set_num_threads(1)
    arm = Arm("dspark", "dspark", args.concurrency, args.temperature, 64, args.profile, True)
    prompts = [encode_prompt(arm.target, p) for d in ("code", "prose", "math") for p in load_eval_prompts(d, 40)]
    engine, issued = arm.engine, 0
    infos: list[StepInfo] = []
    engine.on_step = infos.append

    def top_up() -> None:
        nonlocal issued
        while len(engine.running) + len(engine.prefilling) + len(engine.waiting) < args.concurrency:
            engine.add(Request(prompts[issued % len(prompts)], SamplingParams(temperature=args.temperature,
                                                                              seed=issued),
                               max_tokens=100 + (issued * 37) % 200))
            issued += 1

    for _ in range(args.warmup):
        top_up()
        engine.step()
    s = engine.scheduler  # a back-off as a probe that found no gain starts one (without extending it further)
    s._skip, s._probing, s._backoff_rows, s._ends = args.backoff, False, len(engine.running), []
    start = len(infos)
    for _ in range(args.steps):
        top_up()
        engine.step()
    steps = infos[start:]
    lines = [" ".join(sys.argv),
             f"{args.concurrency} requests, temperature {args.temperature:g}: a back-off of {args.backoff} steps "
             f"forced after {args.warmup}, then {args.steps} steps (wake_lead {s.wake_lead})",
             f"{'mode':14s} {'steps':>5s} {'round ms':>9s} {'outside ms':>11s} {'sorts':>6s} {'sort ms':>8s} "
             f"{'faults':>7s} {'gc ms':>6s}  (medians; sorts: steps that reordered rows, their median)"]
    for name in ("asleep", "awake, plain", "drafting"):
        part = [i for i in steps if mode(i) == name]
        if not part:
            continue
        sorts = [i.sort_seconds for i in part if i.sort_seconds > 0.005]
        lines.append(f"{name:14s} {len(part):5d} {1e3 * statistics.median(i.seconds for i in part):9.1f} "
                     f"{1e3 * statistics.median(i.step_seconds - i.seconds for i in part):11.1f} {len(sorts):6d} "
                     f"{1e3 * statistics.median(sorts) if sorts else 0.0:8.1f} "
                     f"{statistics.median(i.page_faults or 0 for i in part):7.0f} "
                     f"{1e3 * sum(i.gc_seconds for i in part) / len(part):6.2f}")
    lines.append("steps over 50 ms outside their round:")
    for j, i in enumerate(steps):
        if i.step_seconds - i.seconds > 0.05:
            lines.append(f"  step {j:3d} ({mode(i)}, {i.batch} rows): "
                         f"{1e3 * (i.step_seconds - i.seconds):.1f} ms outside (sort {1e3 * i.sort_seconds:.1f}, "
                         f"prefill {1e3 * i.prefill_seconds:.1f}, gc {1e3 * i.gc_seconds:.1f}), "
                         f"{i.page_faults} page faults")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
