"""`dspark trace` records scheduler traces; `dspark simulate` replays them under schedulers and cost curves.

A trace keeps, per request and round, the survival signals, the drafts available and how many the whole block
had accepted (`dspark.evaluation.simulate`); the simulator replays traces at any concurrency on this machine's
step profile or a GPU-shaped curve, with the assumptions its docstring states.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_trace_parsers(subparsers) -> None:
    """Add the `trace` and `simulate` subcommands to the `dspark` parser's subparsers."""
    from dspark.api import DRAFTER_NAMES
    from dspark.arguments import domain_arg, drafter_arg, existing_path_arg, int_arg, real_arg, scheduler_arg

    t = subparsers.add_parser("trace", help="record scheduler traces (per round: survival signals, drafts "
                                            "available and accepted by the whole block) on held-out prompts")
    t.add_argument("drafter", type=drafter_arg, help=f"{' | '.join(DRAFTER_NAMES)} | PATH")
    t.add_argument("--out", required=True, help="folder for one trace JSON per domain")
    t.add_argument("--domains", nargs="+", default=["code", "prose", "math"], type=domain_arg)
    t.add_argument("--temperature", type=real_arg(0.0), default=1.0)
    t.add_argument("--prompts", type=int_arg(1), default=20, help="held-out prompts per domain")
    t.add_argument("--max-new-tokens", type=int_arg(1), default=128)
    t.add_argument("--batch-size", type=int_arg(1), default=8)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--target", default=None, help="target model folder (default: the bundled target)")
    t.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    t.set_defaults(func=cmd_trace)

    s = subparsers.add_parser("simulate", help="replay traces under schedulers at many concurrencies on a "
                                               "step profile or a GPU-shaped cost curve")
    s.add_argument("traces", nargs="+", type=existing_path_arg, help="trace JSON files written by `dspark trace`")
    cost = s.add_mutually_exclusive_group(required=True)
    cost.add_argument("--profile", type=existing_path_arg, help="a step profile written by `dspark profile`")
    cost.add_argument("--gpu-curve", type=existing_path_arg,
                      help="JSON spec of a GPU-shaped curve (e.g. benchmarks/results/scheduling/gpu_curve.json)")
    s.add_argument("--schedulers", nargs="+", type=scheduler_arg,
                   default=["none", "fixed:1", "fixed:3", "fixed", "threshold:0.6", "dspark", "dspark-async"])
    s.add_argument("--concurrency", nargs="+", type=int_arg(1), default=[1, 4, 16, 64, 256])
    s.add_argument("--calibration", type=existing_path_arg, default=None,
                   help="calibration JSON for the survivals (default: the uncalibrated default map)")
    s.add_argument("--steps", type=int_arg(1), default=None, help="steps per simulation (default: until "
                                                                  "2·max(requests, concurrency) finish)")
    s.add_argument("--json", default=None, help="also write every row as JSON here")
    s.set_defaults(func=cmd_simulate)


def cmd_trace(args: argparse.Namespace) -> int:
    """Record one trace per domain and save it under --out."""
    from dspark.api import encode_prompt, load_drafter, load_target
    from dspark.evaluation.bench import load_eval_prompts
    from dspark.evaluation.simulate import record_trace

    target = load_target(args.target, args.dtype)
    drafter = load_drafter(args.drafter, target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = Path(args.drafter).name
    for domain in args.domains:
        prompts = [encode_prompt(target, p) for p in load_eval_prompts(domain, args.prompts)]
        trace = record_trace(target, drafter, prompts, args.temperature, args.max_new_tokens, args.batch_size,
                             domain, args.seed)
        path = out / f"{name}_{domain}_T{args.temperature:g}.json"
        trace.save(path)
        rounds = sum(r.num_rounds for r in trace.requests)
        print(f"{domain}: {len(trace)} requests, {rounds} rounds, γ={trace.gamma}, τ(full block)={trace.tau:.2f} "
              f"-> {path}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    """Print tokens/s and speed-up over "none" per scheduler and concurrency (and write --json)."""
    from dspark.calibration.maps import Calibration
    from dspark.evaluation.simulate import Trace, concurrency_sweep, format_concurrency_table, load_gpu_curve

    traces = [Trace.load(p) for p in args.traces]
    gammas = {t.gamma for t in traces}
    if len(gammas) != 1:
        raise ValueError(f"traces of different block widths cannot be pooled: γ = {sorted(gammas)}")
    gamma = gammas.pop()
    if args.profile:
        from dspark.profiling import load_profile

        cost = load_profile(args.profile).cost
    else:
        cost = load_gpu_curve(args.gpu_curve, max_drafts=gamma + 1)
    survival = Calibration.load(args.calibration) if args.calibration else None
    rows = concurrency_sweep(traces, args.schedulers, cost, survival, args.concurrency, args.steps)
    print("simulated tokens/s (speed-up over none at the same concurrency)")
    print(format_concurrency_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    sys.stdout.flush()
    return 0
