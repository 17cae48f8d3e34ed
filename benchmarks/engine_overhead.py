"""Where an engine step's time goes at a fixed number of concurrent requests (closed loop, in process).

    python benchmarks/engine_overhead.py [--concurrency 16] [--steps 150] [--scheduler dspark] [--drafter dspark]
        [--max-tokens 64] [--temperature 0] [--profile FILE] [--stagger] [--out FILE]

Keeps `--concurrency` requests running (a finished request is replaced at once by the next held-out prompt),
skips the first 20 steps, and splits every step into: the drafting call, survival + scheduler, the target
pass, the prefill pass of arriving requests, their join into the batch, and the rest (verification, rollback, the drafter's feedback,
online calibration and cost correction, commit, stop checks, admission and row bookkeeping). The engine's
own overhead is that rest plus the scheduling share.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from dspark.api import encode_prompt, load_drafter, load_target, step_cost_model
from dspark.engine import Engine, EngineConfig, Request, StepInfo
from dspark.evaluation.bench import load_eval_prompts
from dspark.sampling import SamplingParams
from dspark.scheduling import Scheduler
from dspark.drafters.base import drafter_gamma


def closed_loop(engine: Engine, prompts: list[list[int]], concurrency: int, warmup: int, steps: int, max_tokens: int,
                temperature: float, stagger: bool, watch=None) -> list[StepInfo]:
    """Keep `concurrency` requests running in `engine` (a finished one is replaced at once by the next prompt)
    and return the StepInfo of `steps` steps after the first `warmup`. stagger: the first requests ask for
    1..max_tokens tokens, so later arrivals spread over the steps. watch(engine): called after each step that
    ran a round."""
    infos: list[StepInfo] = []
    engine.on_step = infos.append
    issued = 0

    def issue() -> None:
        nonlocal issued
        length = max_tokens
        if stagger and issued < concurrency:
            length = 1 + issued * max_tokens // concurrency
        engine.add(Request(prompts[issued % len(prompts)], SamplingParams(temperature=temperature, seed=issued),
                           max_tokens=length, ignore_eos=True))
        issued += 1

    for _ in range(concurrency):
        issue()
    while len(infos) < warmup + steps:
        before = len(infos)
        for out in engine.step():
            if out.finished:
                issue()
        if watch is not None and len(infos) > before:
            watch(engine)
    return infos[warmup:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--scheduler", default="dspark")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--stagger", action="store_true",
                    help="the first requests ask for 1..max_tokens tokens, so later ones arrive spread over steps "
                         "(default: all start together and every wave arrives at once)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/serving/engine_overhead_T<T>_<scheduler>.txt")
    args = ap.parse_args()

    target = load_target()
    drafter = load_drafter(args.drafter, target)
    cost = None
    if Scheduler(args.scheduler, drafter_gamma(drafter)).needs_cost:
        cost = step_cost_model(target, drafter, args.concurrency, args.profile)
    prompts = [encode_prompt(target, p) for d in ("code", "prose", "math") for p in load_eval_prompts(d, 40)]
    engine = Engine(target, drafter, args.scheduler, cost, EngineConfig(max_running=args.concurrency))
    steps = closed_loop(engine, prompts, args.concurrency, args.warmup, args.steps, args.max_tokens,
                        args.temperature, args.stagger)
    total = sum(s.step_seconds for s in steps)
    parts = {
        "drafting call": sum(s.draft_seconds for s in steps),
        "survival + scheduler": sum(s.schedule_seconds for s in steps),
        "target pass": sum(s.target_seconds for s in steps),
        "prefill pass": sum(s.prefill_seconds - s.join_seconds for s in steps),
        "join (rows into the batch)": sum(s.join_seconds for s in steps),
    }
    parts["verify, commit, bookkeeping"] = total - sum(parts.values())
    lines = [f"python benchmarks/engine_overhead.py {' '.join(sys.argv[1:])}",
             f"{len(steps)} steps at {args.concurrency} concurrent requests, scheduler {args.scheduler}, drafter "
             f"{args.drafter}, temperature {args.temperature:g}; median step {statistics.median(s.step_seconds for s in steps) * 1e3:.1f} ms, "
             f"median batch {statistics.median(s.batch for s in steps):.0f}"]
    for name, sec in parts.items():
        lines.append(f"  {name:<28} {100 * sec / total:5.1f}%  ({1e3 * sec / len(steps):6.2f} ms/step)")
    fed = sum(s.prefill_tokens for s in steps)
    lines.append(f"  prefill: {fed / len(steps):.1f} prompt tokens/step, "
                 f"{1e3 * parts['prefill pass'] / max(fed, 1):.3f} ms per prompt token")
    committed = sum(len(s.accepted) + sum(s.accepted) for s in steps)
    lines.append(f"  committed {committed / len(steps):.1f} tokens/step: {committed / total:.0f} tokens/s in process "
                 f"(compare with the HTTP load sweep at the same concurrency)")
    overhead = parts["verify, commit, bookkeeping"] + parts["survival + scheduler"]
    lines.append(f"  engine overhead (outside drafter, target and prefill passes): {100 * overhead / total:.1f}%")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out or f"benchmarks/results/serving/engine_overhead_T{args.temperature:g}_"
                              f"{args.scheduler.replace(':', '_')}.txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
