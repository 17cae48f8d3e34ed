"""`dspark serve`: load the target and drafter, build the engine, serve the OpenAI API with uvicorn.

SIGTERM / SIGINT shut down gracefully: new requests get 503, running ones finish (at most --shutdown-timeout
seconds, then they are cancelled), and the command exits 0.
"""
from __future__ import annotations

import argparse
import gc
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from dspark.host_memory import retain_freed_memory

if TYPE_CHECKING:
    from dspark.engine import EngineConfig


class GracefulServer(uvicorn.Server):
    """uvicorn's server that first stops the runner taking requests when a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, runner) -> None:
        super().__init__(config)
        self.runner = runner

    def handle_exit(self, sig, frame) -> None:
        """Refuse new requests (503), then let uvicorn drain the open connections and stop."""
        self.runner.stop_accepting()
        super().handle_exit(sig, frame)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to the `dspark` parser's subparsers; return it."""
    from dspark.api import DRAFTER_NAMES
    from dspark.arguments import device_arg, drafter_arg, int_arg, real_arg, scheduler_arg

    s = subparsers.add_parser("serve", help="serve the OpenAI-compatible API (completions, chat, metrics)")
    s.add_argument("--target", default=None, help="target model folder (default: the bundled target)")
    s.add_argument("--drafter", default="dspark", type=drafter_arg, help=f"{' | '.join(DRAFTER_NAMES)} | PATH")
    s.add_argument("--scheduler", default="dspark", type=scheduler_arg,
                   help="none | fixed | fixed:K | threshold:θ | batch-table | dspark | dspark-async (default: dspark, "
                        "which needs this setup's step-cost profile: --profile, the cache, or measured on start)")
    s.add_argument("--profile", default=None, help="step-cost profile JSON for dspark / dspark-async")
    s.add_argument("--cost-lookup", default="auto", choices=["auto", "step", "linear"],
                   help="how the step-cost profile is read between its batch sizes and token counts: linear "
                        "(interpolated, as a CPU's steps grow), step (rounded up to the next profiled one, as a GPU "
                        "engine pads to captured sizes) or auto, the device's way (default)")
    s.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--device", default="cpu", type=device_arg, help="torch device, e.g. cpu or cuda")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int_arg(0, 65535), default=8000, help="TCP port (0: any free port)")
    s.add_argument("--max-running", type=int_arg(1), default=64, help="requests decoding at once")
    s.add_argument("--max-waiting", type=int_arg(1), default=1024, help="queued requests before answering 429")
    s.add_argument("--kv-budget-tokens", type=int_arg(1), default=None,
                   help="most KV cache slots (rows x padded width) the target's cache may allocate; requests wait "
                        "beyond it, and one that alone exceeds it is refused (default: no limit)")
    s.add_argument("--prefill-chunk", type=int_arg(1), default=256,
                   help="prompt tokens a prefill chunk feeds per step while others decode (slots, rows x width, of "
                        "a chunk in a pass of its own)")
    s.add_argument("--fuse-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="feed prefill chunks in the running requests' target pass, one model call per step where "
                        "the target's attention allows (default: on)")
    s.add_argument("--no-online-calibration", action="store_true",
                   help="keep the drafter's offline calibration fixed (default: corrected online per workload)")
    s.add_argument("--no-online-cost", action="store_true", help="do not correct the step-cost model online")
    s.add_argument("--pass-fit", action=argparse.BooleanOptionalAction, default=True,
                   help="learn online what target passes cost beyond the profile (the cache's context, a fused "
                        "prefill chunk's share) and price steps with it (default: on)")
    s.add_argument("--paid-compaction", action=argparse.BooleanOptionalAction, default=False,
                   help="compact the KV cache once its holes have cost the attention a compaction costs (rent or "
                        "buy), besides when they pass half its longest row (default: off)")
    s.add_argument("--row-groups", type=int, default=1,
                   help="padded KV caches the running rows may be split over by length, so that a long prompt "
                        "does not widen every short row's attention (default: 1, one cache; 2: split)")
    s.add_argument("--row-segments", action=argparse.BooleanOptionalAction, default=True,
                   help="on a CPU, split attention into runs of rows over the slots from their first one, and order "
                        "the running rows by where their text starts when that reads fewer slots (default: on)")
    s.add_argument("--rate-guard", action=argparse.BooleanOptionalAction, default=False,
                   help="adaptive schedulers: also turn drafting off for whole windows when measured throughput "
                        "says plain decoding is faster (default: off; the cost model decides)")
    s.add_argument("--drafter-sleep", action=argparse.BooleanOptionalAction, default=True,
                   help="adaptive schedulers: let a drafter that reads target features drop its per-request state "
                        "during long back-offs (default: on)")
    s.add_argument("--retain-freed-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="keep freed large blocks in the heap for the next step's tensors instead of mapping fresh "
                        "pages (glibc; default: on, unless DSPARK_RETAIN_FREED_MEMORY=0)")
    s.add_argument("--step-log", default=None, metavar="FILE",
                   help="append one JSON line per engine step (batch, tokens, timings, the cost model's prediction)")
    s.add_argument("--threads", type=int_arg(1), default=None,
                   help="torch intra-op threads of the engine (default on a CPU: one fewer than its cores, at least "
                        "1, leaving a core to the HTTP server; elsewhere torch's default)")
    s.add_argument("--served-model-name", default=None,
                   help="the `model` clients ask for (default: the target folder's name)")
    s.add_argument("--shutdown-timeout", type=real_arg(0.0), default=30.0,
                   help="seconds running requests may take to finish after SIGTERM before they are cancelled")
    s.set_defaults(func=cmd_serve)
    return s


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's settings from `dspark serve`'s arguments."""
    from dspark.engine import EngineConfig

    return EngineConfig(max_running=args.max_running, max_waiting=args.max_waiting, prefill_chunk=args.prefill_chunk,
                        online_cost=not args.no_online_cost, kv_budget_tokens=args.kv_budget_tokens,
                        rate_guard=args.rate_guard, drafter_sleep=args.drafter_sleep,
                        fuse_prefill=args.fuse_prefill, pass_fit=args.pass_fit,
                        paid_compaction=args.paid_compaction, row_groups=args.row_groups,
                        sort_rows=args.row_segments)


def freeze_heap() -> int:
    """Collect garbage, then move every object alive now (models, tokenizer, engine, app) out of the garbage
    collector's reach (`gc.freeze`) and return how many there are (about 393,000 with one engine, most of them
    torch's and transformers' own). A full collection otherwise walks them all: one took 200 ms inside a
    decoding step, a pause every stream feels and a stall the online cost model must not learn from."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM / SIGINT; return 0 after a graceful shutdown."""
    import torch

    from dspark.api import load_drafter, load_target, step_cost_model
    from dspark.arguments import serving_threads
    from dspark.attention import set_segmenting
    from dspark.drafters.base import drafter_gamma
    from dspark.engine import Engine
    from dspark.engine.steplog import StepLog, chain
    from dspark.scheduling import Scheduler
    from dspark.serving.app import create_app
    from dspark.serving.metrics import ServerMetrics
    from dspark.serving.runner import EngineRunner
    from dspark.zoo import default_target_path

    step_log = None
    if args.step_log:  # a bad path fails before the models load
        try:
            step_log = StepLog(args.step_log)
        except OSError as err:
            raise ValueError(f"--step-log: cannot write {args.step_log}: {err.strerror or err}") from None
    threads = serving_threads(args.device, args.threads)
    if threads is not None:
        torch.set_num_threads(threads)
    set_segmenting(args.row_segments)
    target = load_target(args.target, args.dtype, args.device)
    drafter = load_drafter(args.drafter, target)
    gamma = drafter_gamma(drafter)
    scheduler = Scheduler(args.scheduler, gamma)
    if not scheduler.never_drafts:
        drafter.prepare()  # caches built lazily would stall one serving step for every stream
    cost = (step_cost_model(target, drafter, args.max_running, args.profile,
                            lookup=None if getattr(args, "cost_lookup", "auto") == "auto" else args.cost_lookup)
            if scheduler.needs_cost else None)
    calibrator = None
    if not args.no_online_calibration and getattr(drafter, "calibration", None) is not None and gamma > 0:
        from dspark.calibration.online import OnlineCalibrator

        calibrator = OnlineCalibrator(prior=drafter.calibration, gamma=gamma)
    config = engine_config(args)
    metrics = ServerMetrics()
    engine = Engine(target, drafter, scheduler, cost, config, calibrator, on_step=chain(metrics.observe_step, step_log))
    metrics.watch(engine)
    runner = EngineRunner(engine, on_outputs=metrics.observe_outputs)
    name = args.served_model_name or Path(args.target or default_target_path()).name
    app = create_app(runner, name, metrics)
    server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                           timeout_graceful_shutdown=args.shutdown_timeout), runner)
    frozen = freeze_heap()
    kept = "freed memory kept for reuse" if args.retain_freed_memory and retain_freed_memory() else \
        "the C allocator as it was"
    print(f"dspark: serving {name!r} at http://{args.host}:{args.port}/v1 (drafter {args.drafter}, scheduler "
          f"{args.scheduler}, {torch.get_num_threads()} torch threads; {frozen} objects frozen out of garbage "
          f"collection; {kept})", file=sys.stderr)
    runner.start()
    # uvicorn re-raises the signal it caught once it has stopped; a no-op handler makes that an exit 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        runner.shutdown(drain=False)
        if step_log is not None:
            step_log.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
