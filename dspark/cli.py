"""`dspark` command line: generate text and benchmark drafters on the bundled models."""
from __future__ import annotations

import argparse
import json
import sys
import time

from dspark.api import DRAFTER_NAMES, generate, load_drafter, load_target
from dspark.arguments import (Parser, check_domain, device_arg, domain_arg, drafter_arg, existing_path_arg, int_arg,
                              label_arg, real_arg, scheduler_arg)
from dspark.calibration.fit import METHODS
from dspark.host_memory import retain_freed_memory

POSITIVE = int_arg(1)
COUNT = int_arg(0)
TEMPERATURE = real_arg(0.0)
TOP_P = real_arg(0.0, 1.0, low_open=True)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target model folder (default: the bundled target)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", type=device_arg, help="torch device, e.g. cpu or cuda")
    p.add_argument("--gamma", type=POSITIVE, default=None, help="draft tokens per round (drafter default if unset)")
    p.add_argument("--calibration", default="auto",
                   help="survival calibration JSON (default: calibration.json beside the drafter; 'none': uncalibrated)")
    p.add_argument("--bias-candidates", type=POSITIVE, default=None,
                   help="DSpark's Markov bias on each slot's top-K base logits only (default: the whole vocabulary); "
                        "exact, but it lowers the bundled drafter's tau (benchmarks/results/rank/)")


class _Streamer:
    """Prints the decoded text of one request as tokens arrive, holding back incomplete UTF-8."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, index: int, tokens: list[int]) -> None:
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        sys.stdout.write(text[self.printed :])
        sys.stdout.flush()
        self.printed = len(text)


def _calibration_arg(args: argparse.Namespace):
    value = getattr(args, "calibration", "auto")
    return None if value == "none" else value


def _add_scheduler_args(p: argparse.ArgumentParser, many: bool = False) -> None:
    help_names = "none | fixed | fixed:K | threshold:θ | batch-table[:B=K,...] | dspark | dspark-async"
    if many:
        p.add_argument("--schedulers", nargs="+", default=["fixed"], type=scheduler_arg,
                       help=f"schedulers to compare, each with every drafter: {help_names} (default: fixed, the whole block)")
    else:
        p.add_argument("--scheduler", default="fixed", type=scheduler_arg,
                       help=f"how many drafts each request verifies per step: {help_names} (default: fixed, the whole block)")
    p.add_argument("--profile", default=None,
                   help="step-cost profile JSON for dspark / dspark-async (default: this setup's cached profile, "
                        "measured on first use; see `dspark profile`)")


def cmd_generate(args: argparse.Namespace) -> int:
    target = load_target(args.target, args.dtype, args.device)
    drafter = load_drafter(args.drafter, target, args.gamma, args.bias_candidates, _calibration_arg(args))
    streamer = _Streamer(target.tokenizer)
    start = time.perf_counter()
    (result,) = generate(
        target,
        drafter,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        chat=not args.raw,
        on_tokens=streamer,
        scheduler=args.scheduler,
        profile=args.profile,
        workload=args.workload,
    )
    seconds = time.perf_counter() - start
    n = len(result.token_ids)
    print()
    print(
        f"tokens={n} rounds={len(result.rounds)} tau={result.tau:.2f} tok/s={n / seconds:.1f} "
        f"drafter={args.drafter} scheduler={args.scheduler} finish={result.finish_reason}"
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from dspark.evaluation.bench import run_bench

    run_bench(
        drafters=args.drafters,
        domains=args.domains,
        temperatures=args.temperatures,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        target_path=args.target,
        dtype=args.dtype,
        device=args.device,
        gamma=args.gamma,
        bias_candidates=args.bias_candidates,
        json_path=args.json,
        seed=args.seed,
        plot_path=args.plot,
        schedulers=args.schedulers,
        profile=args.profile,
    )
    return 0


def _check_calibrate(args: argparse.Namespace) -> str | None:
    if args.prompts:
        return None
    for d in args.domains:
        try:
            check_domain(d)
        except ValueError as err:
            return f"argument --domains: {err}"
    return None


def cmd_calibrate(args: argparse.Namespace) -> int:
    from dspark.api import calibration_path
    from dspark.calibration.job import read_prompt_files, run_calibrate

    texts = None if not args.prompts else read_prompt_files(args.prompts, args.domains)  # checked before loading
    if texts is None:
        args.eval_prompts = 40 if args.eval_prompts is None else args.eval_prompts
        args.fit_prompts = 40 if args.fit_prompts is None else args.fit_prompts
    elif args.eval_prompts is None and (args.fit_prompts is not None or args.fit_offset is not None):
        raise ValueError("with --prompts, give --eval-prompts together with --fit-prompts / --fit-offset, "
                         "or none of them (each domain's prompts are then split alternately)")
    target = load_target(args.target, args.dtype, args.device)
    drafter = load_drafter(args.drafter, target, args.gamma, calibration=None)
    out = args.out or calibration_path(drafter)
    if out is None:
        raise ValueError(f"drafter {args.drafter!r} has no folder to keep a calibration beside: give --out FILE")
    run_calibrate(target, drafter, out, args.temperatures, args.domains, label=getattr(drafter, "name", args.drafter),
                  fit_prompts=args.fit_prompts, eval_prompts=args.eval_prompts, fit_offset=args.fit_offset,
                  prompt_texts=texts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                  plot_dir=args.plot_dir, records_dir=args.records_dir, method=args.method,
                  from_records=args.from_records, greedy_peaks=not args.ignore_greedy_peaks)
    print(f"wrote {out}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from dspark.identity import drafter_id
    from dspark.profiling import default_profile_path, fingerprint_for, plot_profile, profile_steps

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    target = load_target(args.target, args.dtype, args.device)
    drafter = load_drafter(args.drafter, target, args.gamma, calibration=None)
    prof = profile_steps(target, drafter, batches=args.batches, context_len=args.context_len, warmup=args.warmup,
                         reps=args.reps, drafter_name=getattr(drafter, "name", args.drafter))
    out = args.out or default_profile_path(fingerprint_for(target, drafter, getattr(drafter, "name", args.drafter),
                                                           args.context_len))
    prof.save(out)
    if args.plot:
        plot_profile(prof, args.plot)
    cost = prof.cost
    print(f"step cost of {drafter_id(drafter)} at context {args.context_len} (ms; N = query tokens of the target pass)")
    for b in sorted(cost.drafted):
        cells = " ".join(f"N={n}:{s * 1e3:.1f}" for n, s in cost.drafted[b])
        print(f"B={b:<4} plain {cost.plain[b] * 1e3:.1f} | drafted {cells}")
    print(f"wrote {out}")
    return 0


def cmd_regenerate(args: argparse.Namespace) -> int:
    from dspark.sampling import SamplingParams
    from dspark.training.data import regenerate
    from dspark.training.prompts import read_prompts

    target = load_target(args.target, args.dtype, args.device)
    drafter = load_drafter(args.drafter, target, args.gamma, args.bias_candidates)
    prompts = [p for path in args.prompts for p in read_prompts(path, args.limit, args.skip)]
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    regenerate(target, drafter, prompts, args.out, sampling, args.max_new_tokens, args.batch_size, args.seed)
    print(f"wrote {len(prompts)} regenerated conversations to {args.out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from dspark.training.recipes import train_drafter
    from dspark.training.trainer import TrainConfig

    target = load_target(args.target, "float32", args.device)
    cfg = TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed, ckpt_every=args.ckpt_every,
                      bf16=_use_bf16(args))
    last = train_drafter(args.kind, target, args.data, args.out, cfg, layers=args.layers, block_size=args.block_size,
                         markov_rank=args.markov_rank or (256 if args.kind == "dspark" else 32), num_anchors=args.num_anchors,
                         intermediate_size=args.intermediate_size, int8=args.int8, markov_head=args.markov_head,
                         feature_cache=args.feature_cache, tensorboard=args.tensorboard)
    print(f"trained {args.kind}: {json.dumps(last)}")
    return 0


def _use_bf16(args: argparse.Namespace) -> bool:
    """bf16 autocast unless --no-bf16 or the device lacks native bf16 (then float32, said once)."""
    from dspark.training.trainer import bf16_supported

    if args.no_bf16:
        return False
    if not bf16_supported(args.device):
        print(f"dspark: {args.device} has no native bfloat16; training in float32", file=sys.stderr)
        return False
    return True


def cmd_cache_features(args: argparse.Namespace) -> int:
    import torch

    from dspark.training.data import training_sequences
    from dspark.training.feature_cache import build_feature_cache
    from dspark.training.recipes import spread_layer_ids
    from dspark.training.trainer import init_distributed

    target = load_target(args.target, "float32", args.device)
    init_distributed(target.device)
    layers = args.layers or spread_layer_ids(int(target.model.config.num_hidden_layers), 5)
    sequences = training_sequences(args.data, args.max_len)
    bf16 = _use_bf16(args)
    cache = build_feature_cache(target.model, sequences, layers, args.out,
                                dtype=torch.bfloat16 if bf16 else torch.float32, autocast=bf16)
    print(f"feature cache of {len(sequences)} sequences, target layers {cache.meta['layer_ids']}, in {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the `dspark` command."""
    parser = Parser(prog="dspark", description="Adaptive speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a continuation of PROMPT, then one statistics line")
    g.add_argument("prompt")
    g.add_argument("--drafter", default="dspark", type=drafter_arg, help=f"{' | '.join(DRAFTER_NAMES)} | PATH")
    g.add_argument("--temperature", type=TEMPERATURE, default=0.0)
    g.add_argument("--top-k", type=COUNT, default=0)
    g.add_argument("--top-p", type=TOP_P, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-new-tokens", type=POSITIVE, default=128)
    g.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    g.add_argument("--workload", default=None, type=label_arg, help="workload label (e.g. math) whose survival calibration the "
                                                    "adaptive schedulers use, where the drafter's has one")
    _add_model_args(g)
    _add_scheduler_args(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="run drafters side by side on the held-out prompts of each domain")
    b.add_argument("--drafters", nargs="+", default=None, type=drafter_arg,
                   help="default: none, ngram and every bundled drafter present in the zoo")
    b.add_argument("--domains", nargs="+", default=["code", "prose", "math"], type=domain_arg)
    b.add_argument("--temperatures", nargs="+", type=TEMPERATURE, default=[0.0, 1.0])
    b.add_argument("--num-prompts", type=POSITIVE, default=20, help="prompts per domain")
    b.add_argument("--max-new-tokens", type=POSITIVE, default=128)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", default=None, help="also write the results to this JSON file")
    b.add_argument("--plot", default=None, help="write a PNG of per-position acceptance per drafter")
    _add_model_args(b)
    _add_scheduler_args(b, many=True)
    b.set_defaults(func=cmd_bench)

    cal = sub.add_parser("calibrate", help="fit a drafter's survival calibration on recorded rounds and report "
                                           "ECE / Brier / AUROC / log loss before and after on disjoint prompts")
    cal.add_argument("drafter", type=drafter_arg, help=f"{' | '.join(DRAFTER_NAMES)} | PATH")
    cal.add_argument("--domains", nargs="+", default=["code", "prose", "math"], type=label_arg,
                     help="domains to calibrate (with --prompts, any labels of the files' rows; else bundled ones)")
    cal.add_argument("--temperatures", "--temperature", nargs="+", type=TEMPERATURE, default=[0.0, 1.0])
    cal.add_argument("--out", default=None, help="calibration JSON (default: calibration.json beside the drafter, "
                                                 "which load_drafter picks up); other temperatures in it are kept")
    cal.add_argument("--fit-prompts", type=POSITIVE, default=None,
                     help="fitting prompts per domain, from --fit-offset on (default 40)")
    cal.add_argument("--fit-offset", type=COUNT, default=None,
                     help="first prompt used for fitting (default 60 of the bundled prompts; with --prompts, "
                          "right after the scored ones)")
    cal.add_argument("--prompts", nargs="+", default=None, metavar="JSONL",
                     help="read prompts per domain from these JSONL files (rows {domain, turns}; e.g. the corpus's "
                          "*_heldout.jsonl) instead of the 120 bundled held-out prompts per domain")
    cal.add_argument("--eval-prompts", type=POSITIVE, default=None,
                     help="scoring prompts per domain, from 0 (disjoint; default 40, or with --prompts and none of "
                          "the three counts given, each domain's even-numbered prompts scored and odd-numbered ones fitted)")
    cal.add_argument("--max-new-tokens", type=POSITIVE, default=128)
    cal.add_argument("--batch-size", type=POSITIVE, default=8)
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--plot-dir", default=None, help="write reliability diagrams (PNG) before/after here")
    cal.add_argument("--method", choices=list(METHODS), default="binned",
                     help="binned: histogram binning on top of Sequential Temperature Scaling (or the logistic "
                          "map of drafters without a confidence head); sts: the scaling alone, as in the paper; "
                          "joint: binning on top of a logistic map of the head logit joined with the drafting "
                          "distribution's max and entropy (a greedy row's peak)")
    cal.add_argument("--ignore-greedy-peaks", action="store_true",
                     help="fit as if greedy rows had no drafting-distribution peak: drafters without a confidence "
                          "head then give greedy rows a per-position prior (the shipped T 0 maps; docs/scheduling.md)")
    cal.add_argument("--from-records", default=None, type=existing_path_arg, metavar="DIR",
                     help="refit on the rounds an earlier run saved with --records-dir instead of decoding")
    cal.add_argument("--records-dir", default=None, help="also save the recorded fitting and held-out rounds "
                                                         "here (safetensors), to refit or rescore without decoding")
    _add_model_args(cal)
    cal.set_defaults(func=cmd_calibrate, check=_check_calibrate, command="calibrate")

    pr = sub.add_parser("profile", help="measure the whole-step cost of decoding on this machine over a grid of "
                                        "(requests, verified tokens) for the dspark schedulers")
    pr.add_argument("--drafter", default="dspark", type=drafter_arg, help=f"{' | '.join(DRAFTER_NAMES)} | PATH")
    pr.add_argument("--batches", type=POSITIVE, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    pr.add_argument("--context-len", type=int_arg(2), default=256)
    pr.add_argument("--warmup", type=COUNT, default=2)
    pr.add_argument("--reps", type=POSITIVE, default=5)
    pr.add_argument("--out", default=None, help="profile JSON (default: this setup's cache file, used automatically)")
    pr.add_argument("--plot", default=None, help="write a PNG of the profile")
    pr.add_argument("--threads", type=POSITIVE, default=None,
                    help="torch intra-op threads (default: torch's; `dspark serve` on a CPU uses one fewer than its "
                         "cores, so profile a server's steps with that many)")
    _add_model_args(pr)
    pr.set_defaults(func=cmd_profile)
    r = sub.add_parser("regenerate", help="answer prompts with the target (drafter training data)")
    r.add_argument("prompts", nargs="+", type=existing_path_arg, help="JSONL files or Hugging Face datasets on disk (save_to_disk folder, "
                   ".parquet, .arrow) of rows with turns, conversations, messages or prompt")
    r.add_argument("--out", required=True)
    r.add_argument("--limit", type=POSITIVE, default=None, help="prompts per file")
    r.add_argument("--skip", type=COUNT, default=0, help="skip the first prompts of each file (extend a data set)")
    r.add_argument("--drafter", default="draft-model", type=drafter_arg,
                   help="drafter that speeds up regeneration (lossless)")
    r.add_argument("--temperature", type=TEMPERATURE, default=0.7)
    r.add_argument("--top-k", type=COUNT, default=20)
    r.add_argument("--top-p", type=TOP_P, default=0.8)
    r.add_argument("--max-new-tokens", type=POSITIVE, default=256)
    r.add_argument("--batch-size", type=POSITIVE, default=16)
    r.add_argument("--seed", type=int, default=0)
    _add_model_args(r)
    r.set_defaults(func=cmd_regenerate)

    c = sub.add_parser("cache-features", help="run the target once over training data and cache its features "
                                               "for `dspark train --feature-cache` (torchrun splits the work)")
    c.add_argument("--data", required=True, type=existing_path_arg, help="JSONL written by `dspark regenerate`")
    c.add_argument("--out", required=True, help="cache folder")
    c.add_argument("--layers", type=COUNT, nargs="+", default=None,
                   help="target layer ids to cache (default: the 5 that `dspark train` drafters read)")
    c.add_argument("--max-len", type=POSITIVE, default=768, help="tokens per sequence, as `dspark train` truncates")
    c.add_argument("--no-bf16", action="store_true", help="cache float32 features, for `dspark train --no-bf16`")
    c.add_argument("--target", default=None)
    c.add_argument("--device", default="cpu", type=device_arg)
    c.set_defaults(func=cmd_cache_features)

    t = sub.add_parser("train", help="train a drafter for the target on regenerated data (torchrun for DDP)")
    t.add_argument("kind", choices=["dflash", "dspark", "dspark-rnn", "eagle3"])
    t.add_argument("--data", required=True, type=existing_path_arg, help="JSONL written by `dspark regenerate`")
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=POSITIVE, default=300)
    t.add_argument("--batch", type=POSITIVE, default=8, help="global sequences per step")
    t.add_argument("--lr", type=real_arg(0.0, low_open=True), default=6e-4)
    t.add_argument("--layers", type=POSITIVE, default=1, help="draft layers (block drafters)")
    t.add_argument("--intermediate-size", type=POSITIVE, default=None, help="MLP width of the draft layers (default: the target's)")
    t.add_argument("--block-size", type=POSITIVE, default=7)
    t.add_argument("--markov-rank", type=POSITIVE, default=None,
                   help="rank of the sequential head (default: 256 for dspark, as bundled and in DeepSpec; 32 for dspark-rnn)")
    t.add_argument("--markov-head", choices=["vanilla", "gated"], default="vanilla",
                   help="dspark's Markov head: vanilla (bias W2·W1[x], as bundled) or gated by the slot's hidden state")
    t.add_argument("--num-anchors", type=POSITIVE, default=64)
    t.add_argument("--feature-cache", default=None, metavar="DIR",
                   help="read the target's features from safetensors shards in DIR, built there on first use and "
                        "reused by later runs on the same data (any drafter kind), instead of a target pass per step")
    t.add_argument("--tensorboard", action="store_true",
                   help="also log the loss terms and per-slot acceptance as TensorBoard events in OUT/tensorboard")
    t.add_argument("--ckpt-every", type=POSITIVE, default=50)
    t.add_argument("--seed", type=int, default=42)
    t.add_argument("--no-bf16", action="store_true")
    t.add_argument("--int8", action="store_true",
                   help="store the trained matrices as int8 rows with float32 scales (default: bfloat16)")
    t.add_argument("--target", default=None)
    t.add_argument("--device", default="cpu", type=device_arg)
    t.set_defaults(func=cmd_train)
    from dspark.serving.cli import add_serve_parser
    add_serve_parser(sub)
    from dspark.export_cli import add_export_parser
    add_export_parser(sub)
    from dspark.trace_cli import add_trace_parsers
    add_trace_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dspark` console command; returns the exit status.

    A bad argument is one line naming it and the accepted values (status 2, no traceback); so is an error
    the command meets in its inputs (a ValueError, a missing or unreadable file).
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # --help, or a bad argument (already reported)
        return stop.code if isinstance(stop.code, int) else 2
    problem = args.check(args) if hasattr(args, "check") else None  # checks across arguments, before loading
    if problem:
        print(f"dspark {args.command}: error: {problem} (see dspark {args.command} --help)", file=sys.stderr)
        return 2
    if getattr(args, "retain_freed_memory", True):  # steps reuse freed blocks instead of faulting in fresh pages
        retain_freed_memory()
    try:
        return args.func(args)
    except (ValueError, OSError) as err:
        print(f"dspark: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
