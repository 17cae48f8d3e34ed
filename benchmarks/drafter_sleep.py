"""Does letting the drafter sleep through long back-offs bring `dspark` to no speculation's speed? (in process)

    python benchmarks/drafter_sleep.py [--concurrency 64] [--steps 600] [--warmup 100] [--runs 3]
        [--temperature 1] [--max-tokens 128] [--profile benchmarks/results/serving/profile_cpu_epyc.json] [--out FILE]

At a load where drafting does not pay, the adaptive scheduler decodes plainly, yet a drafter that reads target
features still keeps every request's context up to date (`drafter_upkeep.py`). With
`EngineConfig.drafter_sleep` the engine drops that context while the scheduler is far into a back-off. This
runs the closed loop of `engine_overhead.py` (staggered first arrivals, a finished request replaced at once)
alternately with no speculation (no drafter), `dspark` with the drafter always awake, and `dspark` with it
sleeping, and reports committed tokens/s per run, the median step, the share of steps drafted and asleep, and
each arm's tokens/s relative to no speculation in the same round of runs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_overhead import closed_loop  # noqa: E402

from dspark.api import encode_prompt, load_drafter, load_target, step_cost_model  # noqa: E402
from dspark.engine import Engine, EngineConfig  # noqa: E402
from dspark.evaluation.bench import load_eval_prompts  # noqa: E402


def run(target, drafter, scheduler: str, sleep: bool, prompts, args) -> dict[str, float]:
    cost = None if scheduler == "none" else step_cost_model(target, drafter, args.concurrency, args.profile)
    engine = Engine(target, drafter, scheduler, cost, EngineConfig(max_running=args.concurrency, drafter_sleep=sleep))
    asleep: list[bool] = []
    steps = closed_loop(engine, prompts, args.concurrency, 0, args.warmup + args.steps, args.max_tokens,
                        args.temperature, stagger=True, watch=lambda e: asleep.append(e._asleep))
    steps, asleep = steps[args.warmup:], asleep[args.warmup:]
    total = sum(s.step_seconds for s in steps)
    committed = sum(len(s.accepted) + sum(s.accepted) for s in steps)
    return {"tokens_per_s": committed / total, "median_ms": 1e3 * statistics.median(s.step_seconds for s in steps),
            "drafted": sum(s.drafted for s in steps) / len(steps), "asleep": sum(asleep) / max(1, len(asleep))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3, help="alternating runs per arm")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--profile", default="benchmarks/results/serving/profile_cpu_epyc.json")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/serving/drafter_sleep/c<C>_T<T>.txt")
    args = ap.parse_args()

    target = load_target()
    drafter = load_drafter(args.drafter, target)
    drafter.prepare()
    prompts = [encode_prompt(target, p) for d in ("code", "prose", "math") for p in load_eval_prompts(d, 40)]
    arms = {"none": ("none", False), "dspark, drafter awake": ("dspark", False), "dspark, drafter sleeps": ("dspark", True)}
    results: dict[str, list[dict[str, float]]] = {a: [] for a in arms}
    for _ in range(args.runs):
        for arm, (scheduler, sleep) in arms.items():
            results[arm].append(run(target, drafter, scheduler, sleep, prompts, args))
            print(arm, results[arm][-1], flush=True)
    lines = [f"python benchmarks/drafter_sleep.py {' '.join(sys.argv[1:])}",
             f"{args.steps} steps after {args.warmup} at {args.concurrency} concurrent requests, temperature "
             f"{args.temperature:g}, up to {args.max_tokens} tokens each, profile {args.profile}; {args.runs} alternating "
             "runs per arm (values per run)",
             f"{'arm':<24} {'tokens/s':>18} {'x none':>18} {'median step ms':>18} {'drafted':>16} {'asleep':>16}"]
    for arm, runs in results.items():
        def col(values: list[float], fmt: str) -> str:
            return "/".join(format(v, fmt) for v in values)
        ratio = [r["tokens_per_s"] / n["tokens_per_s"] for r, n in zip(runs, results["none"])]
        lines.append(f"{arm:<24} {col([r['tokens_per_s'] for r in runs], '.0f'):>18} {col(ratio, '.3f'):>18} "
                     f"{col([r['median_ms'] for r in runs], '.1f'):>18} {col([r['drafted'] for r in runs], '.2f'):>16} "
                     f"{col([r['asleep'] for r in runs], '.2f'):>16}")
    for arm in list(arms)[1:]:
        mean = statistics.mean(r["tokens_per_s"] / n["tokens_per_s"] for r, n in zip(results[arm], results["none"]))
        lines.append(f"{arm}: mean {mean:.3f}x of no speculation")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out or f"benchmarks/results/serving/drafter_sleep/c{args.concurrency}_T{args.temperature:g}.txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
