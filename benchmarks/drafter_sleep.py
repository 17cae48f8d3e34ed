"""Does letting the drafter sleep through long back-offs bring `dspark` to no speculation's speed? (in process)

    python benchmarks/drafter_sleep.py [--concurrency 64] [--steps 600] [--warmup 100] [--temperature 1]
        [--max-tokens 128] [--profile benchmarks/results/serving/profile_cpu_epyc.json] [--out FILE]

At a load where drafting does not pay, the adaptive scheduler decodes plainly, yet a drafter that reads target
features still keeps every request's context up to date (`drafter_upkeep.py`). With
`EngineConfig.drafter_sleep` the engine drops that context while the scheduler is far into a back-off.

Three arms take turns, `--block` engine steps each, so that the machine's drift (15-50% within a minute on
these 2 cores) falls on all of them alike (a block is long enough that the other arms' turns, seen by an
engine as a pause between two of its steps, count as idleness and not as step overhead its cost model would
learn): no speculation (no drafter), `dspark` with the drafter
always awake, `dspark` with it sleeping. Each arm has its own copy of the bundled target (the KV cache lives
in it) and keeps `concurrency` requests running (a finished one is replaced at once; the first ones ask for
1..max_tokens tokens so that arrivals spread over the steps). Reported per arm over the steps after the
warm-up: committed tokens per second of its own step time, the median step, the share of steps that
drafted and that the drafter slept through, and the tokens/s relative to no speculation.
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


class Loop:
    """One arm: an engine kept at `concurrency` running requests, advanced one step at a time."""

    def __init__(self, engine: Engine, prompts: list[list[int]], concurrency: int, max_tokens: int,
                 temperature: float) -> None:
        self.engine, self.prompts, self.max_tokens, self.temperature = engine, prompts, max_tokens, temperature
        self.concurrency, self.issued = concurrency, 0
        self.infos: list[StepInfo] = []
        self.asleep: list[bool] = []
        engine.on_step = self.infos.append
        for _ in range(concurrency):
            self._issue()

    def _issue(self) -> None:
        n = self.issued
        length = 1 + n * self.max_tokens // self.concurrency if n < self.concurrency else self.max_tokens
        self.engine.add(Request(self.prompts[n % len(self.prompts)], SamplingParams(self.temperature, seed=n),
                                max_tokens=length, ignore_eos=True))
        self.issued += 1

    def step(self) -> None:
        before = len(self.infos)
        for out in self.engine.step():
            if out.finished:
                self._issue()
        if len(self.infos) > before:
            self.asleep.append(self.engine._asleep)


def summary(loop: Loop, warmup: int) -> dict[str, float]:
    steps, asleep = loop.infos[warmup:], loop.asleep[warmup:]
    total = sum(s.step_seconds for s in steps)
    committed = sum(len(s.accepted) + sum(s.accepted) for s in steps)
    return {"tokens_per_s": committed / total, "median_ms": 1e3 * statistics.median(s.step_seconds for s in steps),
            "drafted": sum(s.drafted for s in steps) / len(steps), "asleep": sum(asleep) / max(1, len(asleep)),
            "steps": len(steps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--block", type=int, default=50, help="steps per arm per turn")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--profile", default="benchmarks/results/serving/profile_cpu_epyc.json")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/serving/drafter_sleep/c<C>_T<T>.txt")
    args = ap.parse_args()

    arms = {"none": ("none", False), "dspark, drafter awake": ("dspark", False),
            "dspark, drafter sleeps": ("dspark", True)}
    loops: dict[str, Loop] = {}
    for arm, (scheduler, sleep) in arms.items():
        target = load_target()
        drafter = load_drafter(args.drafter, target)
        drafter.prepare()
        cost = None if scheduler == "none" else step_cost_model(target, drafter, args.concurrency, args.profile)
        prompts = [encode_prompt(target, p) for d in ("code", "prose", "math") for p in load_eval_prompts(d, 40)]
        engine = Engine(target, drafter, scheduler, cost, EngineConfig(max_running=args.concurrency, drafter_sleep=sleep))
        loops[arm] = Loop(engine, prompts, args.concurrency, args.max_tokens, args.temperature)
    while min(len(loop.infos) for loop in loops.values()) < args.warmup + args.steps:
        for loop in loops.values():
            for _ in range(args.block):
                if len(loop.infos) < args.warmup + args.steps:
                    loop.step()
    results = {arm: summary(loop, args.warmup) for arm, loop in loops.items()}
    plain = results["none"]["tokens_per_s"]
    lines = [f"python benchmarks/drafter_sleep.py {' '.join(sys.argv[1:])}",
             f"{args.steps} steps after {args.warmup} at {args.concurrency} concurrent requests, temperature "
             f"{args.temperature:g}, up to {args.max_tokens} tokens each, profile {args.profile}; the arms in turns of {args.block} steps",
             f"{'arm':<24} {'tokens/s':>10} {'x none':>8} {'median step ms':>16} {'drafted':>9} {'asleep':>8}"]
    for arm, r in results.items():
        lines.append(f"{arm:<24} {r['tokens_per_s']:>10.0f} {r['tokens_per_s'] / plain:>8.3f} {r['median_ms']:>16.1f} "
                     f"{r['drafted']:>9.3f} {r['asleep']:>8.2f}")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out or f"benchmarks/results/serving/drafter_sleep/c{args.concurrency}_T{args.temperature:g}.txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
