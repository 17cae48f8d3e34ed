"""Verification schedulers at 1..512 concurrent requests, replayed from recorded traces on cost curves.

    python benchmarks/simulate_schedulers.py [--drafter dspark] [--temperature 0] [--prompts 20]
        [--max-new-tokens 128] [--trace-dir DIR] [--profile PATH] [--gpu-curve JSON] [--uniform] [--out DIR]

1. Records (or reads from --trace-dir) one trace per domain (code, prose, math): the bundled target and
   the drafter decode the held-out prompts verifying every whole block, keeping each round's signals,
   available and accepted drafts (`dspark.evaluation.simulate.record_trace`).
2. Loads cost models: this machine's step profile (--profile PATH, else the cached profile of this setup
   if `dspark profile` made one), the GPU-shaped curve of --gpu-curve (default: the shipped illustrative
   8B-on-H100 curve) and, with --uniform or when nothing else is available, a synthetic uniform curve.
3. Per cost model, writes into --out: the threshold sweep per domain (τ, verified drafts per step and
   tokens/s against θ, the paper's Fig. 5) and throughput against concurrency for every scheduler, as
   JSON, PNG and a text table, and prints the tables; with the recorded outcome as survival (--oracle,
   an anticipating upper bound) it replays a few schedulers again, to show what sharper survival estimates
   could still win.

The survival map is the drafter's calibration when `load_drafter` finds one, else the uncalibrated
default. Simulation assumptions are in `dspark.evaluation.simulate.simulate`'s docstring.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dspark.api import encode_prompt, load_drafter, load_target
from dspark.evaluation.bench import load_eval_prompts
from dspark.evaluation.simulate import (
    DEFAULT_CONCURRENCIES,
    OutcomeOracle,
    Trace,
    concurrency_sweep,
    format_concurrency_table,
    format_threshold_table,
    load_gpu_curve,
    plot_concurrency_sweep,
    plot_threshold_sweep,
    record_trace,
    threshold_sweep,
)
from dspark.scheduling import CostModel, uniform_cost_model
from dspark.zoo import DOMAINS

RESULTS = Path(__file__).resolve().parent / "results" / "scheduling"
SCHEDULERS = ("none", "fixed:1", "fixed:3", "fixed:7", "threshold:0.5", "batch-table", "dspark", "dspark-async")
THRESHOLDS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default="dspark", help="drafter name or checkpoint (default dspark)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompts", type=int, default=20, help="held-out prompts per domain")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--domains", default=",".join(DOMAINS))
    p.add_argument("--batch-size", type=int, default=8, help="decode batch while recording traces")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-dir", type=Path, default=None, help="trace cache (default OUT/traces)")
    p.add_argument("--profile", type=Path, default=None, help="a step profile written by `dspark profile`")
    p.add_argument("--gpu-curve", default=str(RESULTS / "gpu_curve.json"),
                   help="JSON spec of a GPU-shaped curve ('' to skip)")
    p.add_argument("--uniform", action="store_true", help="also simulate on the synthetic uniform curve")
    p.add_argument("--schedulers", default=",".join(SCHEDULERS))
    p.add_argument("--concurrencies", default=",".join(map(str, DEFAULT_CONCURRENCIES)))
    p.add_argument("--thresholds", default=",".join(map(str, THRESHOLDS)))
    p.add_argument("--theta-concurrency", type=int, default=16, help="concurrency of the threshold sweep")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per simulation (default: until 2·max(requests, concurrency) requests finish)")
    p.add_argument("--oracle", default="none,fixed:7,dspark,dspark-async",
                   help="schedulers also replayed with the recorded outcome as survival (an anticipating upper "
                        "bound, not a policy); empty: none")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def get_traces(args: argparse.Namespace, target, drafter) -> list[Trace]:
    """One trace per domain, read from the cache when recorded with the same settings."""
    trace_dir = args.trace_dir or args.out / "traces"
    traces = []
    for domain in args.domains.split(","):
        name = Path(args.drafter).name
        path = trace_dir / f"{name}_{domain}_T{args.temperature:g}_p{args.prompts}_m{args.max_new_tokens}_s{args.seed}.json"
        if path.exists():
            trace = Trace.load(path)
            print(f"trace {domain}: read {path}")
        else:
            start = time.perf_counter()
            prompts = [encode_prompt(target, p) for p in load_eval_prompts(domain, args.prompts)]
            trace = record_trace(target, drafter, prompts, args.temperature, args.max_new_tokens,
                                 args.batch_size, domain, args.seed)
            trace.save(path)
            print(f"trace {domain}: recorded {len(trace)} requests in {time.perf_counter() - start:.1f}s -> {path}")
        rounds = sum(r.num_rounds for r in trace.requests)
        print(f"  {len(trace)} requests, {rounds} rounds, γ={trace.gamma}, τ(full block)={trace.tau:.2f}")
        traces.append(trace)
    return traces


def get_cost_models(args: argparse.Namespace, target, drafter, gamma: int) -> dict[str, CostModel]:
    """The cost models to simulate on, by name."""
    models: dict[str, CostModel] = {}
    from dspark import profiling

    if args.profile is not None:
        models["profile"] = profiling.load_profile(args.profile).cost
        print(f"cost: step profile {args.profile}")
    else:
        fingerprint = profiling.fingerprint_for(target, drafter, args.drafter, 256)
        path = profiling.default_profile_path(fingerprint)
        if path.exists():
            try:
                models["profile"] = profiling.load_profile(path, expect=fingerprint).cost
                print(f"cost: this setup's cached step profile {path}")
            except ValueError as err:
                print(f"cost: cached profile not usable ({err})")
        else:
            print("cost: no step profile of this setup (run `dspark profile` or pass --profile)")
    if args.gpu_curve:
        models["gpu"] = load_gpu_curve(args.gpu_curve, max_drafts=gamma + 1)
        print(f"cost: GPU-shaped curve {args.gpu_curve}")
    if args.uniform or not models:
        models["uniform"] = uniform_cost_model(gamma)
        print("cost: synthetic uniform curve")
    return models


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    target = load_target(dtype=args.dtype)
    drafter = load_drafter(args.drafter, target)
    calibration = getattr(drafter, "calibration", None)
    print(f"drafter {args.drafter}: survival map = {'its calibration' if calibration else 'uncalibrated default'}")
    traces = get_traces(args, target, drafter)
    gamma = max(t.gamma for t in traces)
    models = get_cost_models(args, target, drafter, gamma)
    schedulers = args.schedulers.split(",")
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    thresholds = [float(t) for t in args.thresholds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"{Path(args.drafter).name}_T{args.temperature:g}"
    for name, cost in models.items():
        sim_start = time.perf_counter()
        theta_rows = threshold_sweep(traces, cost, calibration, thresholds, args.theta_concurrency, args.steps,
                                     args.seed)
        conc_rows = concurrency_sweep(traces, schedulers, cost, calibration, concurrencies, args.steps, args.seed)
        oracle = [x for x in args.oracle.split(",") if x]
        oracle_rows = concurrency_sweep(traces, oracle, cost, OutcomeOracle(), concurrencies, args.steps,
                                        args.seed) if oracle else []
        seconds = time.perf_counter() - sim_start
        stem = args.out / f"sim_{tag}_{name}"
        title = f"{args.drafter}, T={args.temperature:g}, cost: {name} ({cost.layout})"
        table = format_concurrency_table(conc_rows)
        theta_table = format_threshold_table(theta_rows)
        text = (f"# {title}\n# {' '.join(['python', 'benchmarks/simulate_schedulers.py'] + (argv or sys.argv[1:]))}\n"
                f"\n## aggregate tokens/s (speedup over none) by concurrency\n{table}\n"
                f"\n## median per-user tokens/s\n{format_concurrency_table(conc_rows, 'per_user_median')}\n"
                f"\n## threshold sweep at concurrency {args.theta_concurrency}\n{theta_table}\n")
        if oracle_rows:
            text += ("\n## upper bound: survival = the recorded outcome (1 for the drafts the full block had "
                     "accepted, 0 after; anticipating, not a policy)\n"
                     f"{format_concurrency_table(oracle_rows)}\n")
        Path(f"{stem}.txt").write_text(text)
        Path(f"{stem}.json").write_text(json.dumps({
            "drafter": args.drafter, "temperature": args.temperature, "cost_model": name, "layout": cost.layout,
            "prompts_per_domain": args.prompts, "max_new_tokens": args.max_new_tokens,
            "calibrated": calibration is not None, "theta_concurrency": args.theta_concurrency,
            "traces": [{"domain": t.domain, "requests": len(t), "tau_full_block": t.tau} for t in traces],
            "threshold_sweep": theta_rows, "concurrency_sweep": conc_rows, "oracle_sweep": oracle_rows}, indent=1))
        plot_threshold_sweep(theta_rows, f"{stem}_threshold.png", title)
        plot_concurrency_sweep(conc_rows, f"{stem}_concurrency.png", title)
        print(f"\n{text}\n(simulated in {seconds:.1f}s; wrote {stem}.json/.txt/_threshold.png/_concurrency.png)")
    print(f"total {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
