"""What keeping a drafter up to date costs a step that drafts nothing (in process, closed loop).

    python benchmarks/drafter_upkeep.py [--concurrency 32] [--steps 200] [--runs 2] [--drafter dspark]
        [--temperature 1] [--out FILE]

A drafter that conditions on the target (DSpark, DFlash, EAGLE-3) must see every committed token's target
features even in steps that do not draft: the target pass returns its hidden states, each round's accepted
tokens are appended to the drafter's context cache and joining prompts are projected into it. An adaptive
server pays this while it decodes plainly; a server without speculation does not. This runs the loop of
`engine_overhead.py` (the first requests of lengths 1..max_tokens so that arrivals spread over the steps)
alternately with no drafter and with the drafter attached under a scheduler that never drafts, and reports
the median step, committed tokens/s and where the difference goes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_overhead import closed_loop  # noqa: E402

from dspark.api import encode_prompt, load_drafter, load_target  # noqa: E402
from dspark.drafters import NoDrafter  # noqa: E402
from dspark.drafters.base import drafter_gamma  # noqa: E402
from dspark.engine import Engine, EngineConfig  # noqa: E402
from dspark.evaluation.bench import load_eval_prompts  # noqa: E402
from dspark.scheduling import Scheduler  # noqa: E402


class UpkeepOnly(Scheduler):
    """A scheduler that never calls the drafter, yet is not `none` (the engine then keeps the drafter)."""

    def wants_drafts(self, num_rows: int) -> bool:
        return False


def run(target, drafter, scheduler: Scheduler, prompts, args) -> dict[str, float]:
    engine = Engine(target, drafter, scheduler, None, EngineConfig(max_running=args.concurrency))
    steps = closed_loop(engine, prompts, args.concurrency, args.warmup, args.steps, args.max_tokens, args.temperature,
                        stagger=True)
    total = sum(s.step_seconds for s in steps)
    committed = sum(len(s.accepted) + sum(s.accepted) for s in steps)
    n = len(steps)
    return {"median_ms": 1e3 * statistics.median(s.step_seconds for s in steps), "tokens_per_s": committed / total,
            "target_ms": 1e3 * sum(s.target_seconds for s in steps) / n,
            "prefill_ms": 1e3 * sum(s.prefill_seconds - s.join_seconds for s in steps) / n,
            "join_ms": 1e3 * sum(s.join_seconds for s in steps) / n,
            "rest_ms": 1e3 * sum(s.step_seconds - s.target_seconds - s.prefill_seconds - s.draft_seconds
                                 - s.schedule_seconds for s in steps) / n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--runs", type=int, default=2, help="alternating runs per arm")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/serving/drafter_upkeep/c<C>.txt")
    args = ap.parse_args()

    target = load_target()
    drafter = load_drafter(args.drafter, target)
    prompts = [encode_prompt(target, p) for d in ("code", "prose", "math") for p in load_eval_prompts(d, 40)]
    results: dict[str, list[dict[str, float]]] = {"no drafter": [], f"{args.drafter}, never drafting": []}
    for _ in range(args.runs):
        results["no drafter"].append(run(target, NoDrafter(), Scheduler("none", 0), prompts, args))
        results[f"{args.drafter}, never drafting"].append(
            run(target, drafter, UpkeepOnly("fixed", drafter_gamma(drafter)), prompts, args))
    lines = [f"python benchmarks/drafter_upkeep.py {' '.join(sys.argv[1:])}",
             f"{args.steps} steps after {args.warmup} at {args.concurrency} concurrent requests, temperature "
             f"{args.temperature:g}, {args.runs} alternating runs per arm (values per run)",
             f"{'arm':<26} {'median step ms':>16} {'tokens/s':>14} {'target ms':>12} {'prefill ms':>12} "
             f"{'join ms':>10} {'rest ms':>10}"]
    for arm, runs in results.items():
        def col(key: str, fmt: str) -> str:
            return "/".join(format(r[key], fmt) for r in runs)
        lines.append(f"{arm:<26} {col('median_ms', '.1f'):>16} {col('tokens_per_s', '.0f'):>14} "
                     f"{col('target_ms', '.2f'):>12} {col('prefill_ms', '.2f'):>12} {col('join_ms', '.2f'):>10} "
                     f"{col('rest_ms', '.2f'):>10}")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out or f"benchmarks/results/serving/drafter_upkeep/c{args.concurrency}.txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
