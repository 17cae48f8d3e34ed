"""Scheduler arms side by side in one process: paired blocks of the same requests, so drift and content cancel.

    python benchmarks/interleaved_arms.py --arms dspark fixed:7 [--concurrency 1] [--temperature 1]
        [--blocks 16] [--block-requests 4] [--warmup 1] [--length-spread 0] [--ignore-eos] [--online-calibration]
        [--profile FILE] [--out FILE]

Every arm gets its own engine (its own target and drafter instances, the same weights). A block is the next
`--block-requests` × concurrency held-out prompts (the same prompts and seeds for every arm); each arm in
turn serves the block's requests in a closed loop of `--concurrency` running requests (a finished one is
replaced by the block's next) until all are done, and its wall time counts everything the steps do
(prefills, joins, bookkeeping). The order of the arms reverses every block (A B, B A, ...). A request ends at
the target's EOS or after its `max_tokens`, as a user's does; at temperature 0 every arm commits the same tokens
in a block (lossless), at temperature > 0 samples of the same distribution. `--ignore-eos` makes every request
generate exactly `max_tokens` (the same work in every arm, but drafters accept far fewer tokens on the text a
target writes past EOS; `serve_sweep.py` gives figures). The report gives each arm's tokens per second and
its ratio to the first arm's with a 95% interval over blocks. On this 2-core machine cells of two separate runs swing by 5-20%; paired blocks seconds
apart share the machine's state and the prompts' difficulty. A block's last requests run below the
concurrency while it drains, the same for every arm. `--online-calibration` gives the adaptive arms the
online calibrator `dspark serve` runs with (an arm's `+online` / `+offline` suffix overrides it,
so one run can compare both; `+unfused` runs every prefill chunk in a pass of its own instead of in the
round's, `EngineConfig.fuse_prefill`; `+nopassfit` prices every step at the profile's context and keeps
fused rounds out of the online correction, `EngineConfig.pass_fit`; `+paidcompact` also compacts the cache
once its holes cost what a compaction does, `EngineConfig.paid_compaction`; `+unfolded` runs attention without
folding grouped query heads, `dspark.attention.unfolded`; `+unsegmented` runs each attention call over
every row at once and keeps the rows unsorted, `dspark.attention.unsegmented`, `EngineConfig.sort_rows`; `+onegroup` / `+twogroups` keep the running rows in
one padded cache / split them in two by length, `EngineConfig.row_groups`; `+pathcut` plans a padded step
by admitting single candidates instead of whole widths, `Scheduler.by_width`; `+refitperstep` lets the online
calibrator refit as often as every step, `OnlineCalibrator(refit_steps=1)`; `+oldfold` keeps one folded
attention mask, known by its tensor object, as before the masks of a packed pass were each folded once,
`dspark.attention.one_fold_kept`; `+steplookup` / `+linearlookup` read the step-cost table rounding B and N up
to profiled values / interpolating between them, `CostModel.lookup`, where the default is the device's);
`+nofusedpart` takes a fused round's chunk share without the fused pass's own fixed part (`PassFit.MIXED`);
`+unsureplaincheck` re-measures a stale plain price only while the policy is unsure, below log 1.5
(`Scheduler.PLAIN_CHECK_GAIN`), as before 82dd54a; `+nomargin` switches between drafting and backing off at
a gain of zero, without `Scheduler.SWITCH_MARGIN`; `+fuseprobes` lets a plain probe carry a prefill chunk in its
pass, `EngineConfig.fuse_plain_probes`. `--warmup` blocks run first and are not counted. `--threads` sets torch's threads (a served engine's default on a CPU is one fewer than the cores).

At temperature > 0 an arm's sample depends on its seeds and on how many drafts each round verified: arms
that verify the same lengths (every fixed K, or K and itself) replay the same sample in every block and every
run, while an adaptive arm draws another. τ then differs by the sample alone (at 4 clients, temperature 1,
fixed K = 7 accepted 2.23 drafts per drafted round with one set of seeds and 2.16 with another), and repeated
runs do not average it out: `--seed-offset` shifts every request's seed (and so its length under `--length-spread`).

`--length-spread s` draws each request's length from [(1 - s), (1 + s)] × max_tokens by its seed, as
`serve_sweep.py` does (the same lengths for every arm). With one length for all, the requests of an arm that
never drafts finish in lockstep and their successors share a few prefill passes, while a drafting arm's finish
at different steps and join one by one, each prefill pass paying the pass's fixed cost: an advantage of the
benchmark, not of serving, where lengths differ.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_sweep import request_length  # noqa: E402

from dspark.api import encode_prompt, load_drafter, load_target, step_cost_model
from dspark.atomic import write_text_atomic
from dspark.attention import one_fold_kept, unfolded, unsegmented
from dspark.drafters.base import drafter_gamma
from dspark.engine import Engine, EngineConfig, Request
from dspark.evaluation.bench import load_eval_prompts
from dspark.sampling import SamplingParams
from dspark.host_memory import retain_freed_memory
from dspark.serving.cli import freeze_heap
from dspark.scheduling import CostModel, Scheduler

# two-sided 95% Student t quantiles by degrees of freedom (beyond 30: the normal's)
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
        15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04}


def t95(dof: int) -> float:
    """The two-sided 95% Student t quantile for `dof` degrees of freedom (the nearest tabled one below)."""
    if dof > 30:
        return 1.96
    return _T95[max(k for k in _T95 if k <= dof)]


class Arm:
    """One scheduler's engine, serving blocks of requests in a closed loop of `concurrency` running ones."""

    def __init__(self, spec: str, drafter_name: str, concurrency: int, temperature: float, max_tokens: int,
                 profile: str | None, online: bool, cost: CostModel | None = None, length_spread: float = 0.0,
                 ignore_eos: bool = False) -> None:
        """cost: the step-cost model of an arm that needs one (default: `profile`, as `dspark serve` loads it).
        length_spread: each request's length drawn around max_tokens by its seed (`serve_sweep.request_length`).
        ignore_eos: every request generates its whole length, past the target's EOS."""
        self.spec = spec
        name, *flags = spec.split("+")
        known = ("online", "offline", "unfused", "nopassfit", "paidcompact", "unfolded", "unsegmented", "onegroup",
                 "twogroups", "pathcut", "refitperstep", "oldfold", "steplookup", "linearlookup", "nofusedpart",
                 "unsureplaincheck", "nomargin", "fuseprobes")
        if any(flag not in known for flag in flags):
            raise ValueError(f"arm {spec!r}: a suffix must be +online or +offline (the calibration it runs), "
                             f"+unfused (prefill chunks in passes of their own), +nopassfit (no pass fit), "
                             f"+paidcompact (paid compaction), +unfolded (attention without folded query heads), +unsegmented (attention "
                             f"without row segments) or +oldfold (one folded mask kept, as before) or "
                             f"+onegroup / +twogroups (the running rows in one padded cache / split in two by length) or "
                             f"+pathcut (Algorithm 1 admitting single candidates in the padded layout) or "
                             f"+refitperstep (the online calibrator refitting as often as every step) or "
                             f"+steplookup / +linearlookup (the cost table read rounding up / interpolating) or "
                             f"+nofusedpart (a fused chunk's share without the fused pass's own part) or "
                             f"+unsureplaincheck (stale plain prices re-measured only while unsure) or "
                             f"+nomargin (modes switch at a gain of zero, no hysteresis) or "
                             f"+fuseprobes (plain probes carry a prefill chunk in their pass)")
        online = "online" in flags or (online and "offline" not in flags)
        self.target = load_target()
        drafter = load_drafter(drafter_name, self.target)
        scheduler = Scheduler(name, drafter_gamma(drafter))
        scheduler.by_width = "pathcut" not in flags
        if not scheduler.never_drafts:
            drafter.prepare()
        if scheduler.needs_cost and cost is None:
            cost = step_cost_model(self.target, drafter, concurrency, profile,
                                   lookup="step" if "steplookup" in flags else "linear" if "linearlookup" in flags
                                   else None)
        calibrator = None
        if online and scheduler.adaptive and getattr(drafter, "calibration", None) is not None:
            from dspark.calibration.online import OnlineCalibrator

            calibrator = OnlineCalibrator(prior=drafter.calibration, gamma=drafter_gamma(drafter),
                                          **({"refit_steps": 1} if "refitperstep" in flags else {}))
        config = EngineConfig(max_running=concurrency, fuse_prefill="unfused" not in flags,
                              pass_fit="nopassfit" not in flags, paid_compaction="paidcompact" in flags,
                              row_groups=2 if "twogroups" in flags else 1 if "onegroup" in flags else
                              EngineConfig.row_groups, sort_rows="unsegmented" not in flags,
                              fuse_plain_probes="fuseprobes" in flags)
        if "unsureplaincheck" in flags:
            scheduler.PLAIN_CHECK_GAIN = scheduler.UNSURE_GAIN
        if "nomargin" in flags:
            scheduler.SWITCH_MARGIN = 0.0
        self.engine = Engine(self.target, drafter, scheduler, cost, config, calibrator)
        if "nofusedpart" in flags:
            self.engine._pass_fit.MIXED = 1.0  # fused and unfused passes never both common: no own part read
        self.concurrency, self.temperature, self.ignore_eos = concurrency, temperature, ignore_eos
        self.unfolded = "unfolded" in flags
        self.unsegmented = "unsegmented" in flags
        self.one_fold = "oldfold" in flags
        self.steps: list = []  # the StepInfo of every decoding round served (`accounting`)
        self.lengths = argparse.Namespace(max_tokens=max_tokens, length_spread=length_spread)

    def serve(self, block: list[tuple[list[int], int]]) -> tuple[int, float]:
        """Serve a block of (prompt ids, seed) to completion; return (tokens committed, wall seconds)."""
        pending = list(block)
        tokens, running, start = 0, 0, time.perf_counter()
        chained = self.engine.on_step

        def record(info) -> None:
            self.steps.append(info)
            if chained is not None:
                chained(info)

        self.engine.on_step = record

        def issue() -> None:
            nonlocal running
            prompt, seed = pending.pop(0)
            self.engine.add(Request(prompt, SamplingParams(temperature=self.temperature, seed=seed),
                                    max_tokens=request_length(self.lengths, seed), ignore_eos=self.ignore_eos))
            running += 1

        while pending and running < self.concurrency:
            issue()
        with unfolded() if self.unfolded else nullcontext(), unsegmented() if self.unsegmented else nullcontext(), \
                one_fold_kept() if self.one_fold else nullcontext():
            while running:
                for out in self.engine.step():
                    tokens += len(out.token_ids)
                    if out.finished:
                        running -= 1
                        if pending:
                            issue()
        self.engine.on_step = chained
        return tokens, time.perf_counter() - start

    def accounting(self) -> dict[str, float]:
        """Per decoding round served so far: the share that drafted and that planned, drafts verified and
        accepted per row, drafts accepted per row that verified some (`per_drafted_round`), the mean round
        (drafting, scheduling, target pass, verification, commit) in ms with its drafting, scheduling and target
        pass parts, and the mean width drafted in the rounds that drafted."""
        steps = self.steps
        rows = sum(i.batch for i in steps)
        if not steps or not rows:
            return {}
        drafted = [(n, a) for i in steps for n, a in zip(i.lengths, i.accepted) if n > 0]
        widths = [i for i in steps if i.draft_width is not None]
        return {"rounds": len(steps), "drafted": sum(i.drafted for i in steps) / len(steps),
                "per_drafted_round": sum(a for _, a in drafted) / len(drafted) if drafted else float("nan"),
                "planned": sum(i.planned for i in steps) / len(steps),
                "verified_per_row": sum(sum(i.lengths) for i in steps) / rows,
                "accepted_per_row": sum(sum(i.accepted) for i in steps) / rows,
                "round_ms": 1e3 * sum(i.seconds for i in steps) / len(steps),
                "schedule_ms": 1e3 * sum(i.schedule_seconds for i in steps) / len(steps),
                "draft_ms": 1e3 * sum(i.draft_seconds for i in steps) / len(steps),
                "target_ms": 1e3 * sum(i.target_seconds for i in steps) / len(steps),
                "draft_width": (sum(i.draft_width for i in widths) / len(widths)) if widths else float("nan")}


def make_blocks(prompts: list[list[int]], size: int, count: int, seed_offset: int = 0
                ) -> list[list[tuple[list[int], int]]]:
    """`count` blocks of `size` (prompt, seed): the prompts in turn, request i seeded i + seed_offset."""
    return [[(prompts[i % len(prompts)], i + seed_offset) for i in range(b * size, (b + 1) * size)]
            for b in range(count)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", nargs="+", default=["dspark", "fixed:7"],
                    help="scheduler specs, ratios against the first; an adaptive arm's +online / +offline suffix "
                         "overrides --online-calibration for it (e.g. dspark+offline)")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--block-requests", type=int, default=4, help="requests per block, per running request")
    ap.add_argument("--warmup", type=int, default=1, help="blocks per arm before the counted ones")
    ap.add_argument("--length-spread", type=float, default=0.0,
                    help="request lengths uniform in [(1 - s), (1 + s)] x max-tokens, drawn by seed")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every request generates exactly its length, past the target's EOS (default: it ends there)")
    ap.add_argument("--seed-offset", type=int, default=0, help="added to every request's seed (another sample)")
    ap.add_argument("--profile", default="benchmarks/results/serving/profile_cpu_epyc.json")
    ap.add_argument("--online-calibration", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None, help="write the report here (and its JSON beside it)")
    args = ap.parse_args()
    if len(args.arms) < 2 or args.blocks < 2:
        ap.error("need two arms or more and two blocks or more")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    arms = [Arm(spec, args.drafter, args.concurrency, args.temperature, args.max_tokens, args.profile,
                args.online_calibration, length_spread=args.length_spread, ignore_eos=args.ignore_eos)
            for spec in args.arms]
    prompts = [encode_prompt(arms[0].target, p) for d in ("code", "prose", "math") for p in load_eval_prompts(d, 40)]
    retain_freed_memory()  # as every `dspark` command does (`DSPARK_RETAIN_FREED_MEMORY=0` to compare without)
    freeze_heap()  # as `dspark serve` does: no full garbage collection walks the arms' models inside a step
    size = args.block_requests * args.concurrency
    blocks = make_blocks(prompts, size, args.warmup + args.blocks, args.seed_offset)
    rates: dict[str, list[float]] = {a.spec: [] for a in arms}
    for b, block in enumerate(blocks):
        order = arms if b % 2 == 0 else arms[::-1]
        for arm in order:
            if b == args.warmup:  # account the counted blocks only
                arm.steps = []
            tokens, seconds = arm.serve(block)
            if b >= args.warmup:
                rates[arm.spec].append(tokens / seconds)
        if b >= args.warmup:
            print(f"block {b + 1 - args.warmup}/{args.blocks}: "
                  + ", ".join(f"{a.spec} {rates[a.spec][-1]:.1f}" for a in arms), flush=True)

    first = args.arms[0]
    lines = [f"python benchmarks/interleaved_arms.py {' '.join(sys.argv[1:])}",
             f"{args.concurrency} concurrent requests, temperature {args.temperature:g}, drafter {args.drafter}, "
             f"{args.blocks} blocks of {size} requests of {args.max_tokens} tokens"
             + (f" (spread {args.length_spread:g})" if args.length_spread else "")
             + (", EOS ignored" if args.ignore_eos else ", ending at EOS")
             + " per arm (order reversed every block)",
             f"{'arm':<16} {'tokens/s':>9} {'ratio to ' + first:>22} {'95% interval':>16}",
             "(accepted: drafts accepted per drafted round, over every counted request: at temperature > 0 "
             "it differs between arms by their samples too)"]
    accepted = {a.spec: a.accounting().get("per_drafted_round", float("nan")) for a in arms}
    summary = {"args": vars(args), "rates": rates, "ratios": {}, "accepted_per_drafted_round": accepted}
    for spec in args.arms:
        mean_rate = statistics.mean(rates[spec])
        if spec == first:
            lines.append(f"{spec:<16} {mean_rate:>9.1f} {'':>22} {'':>16}  accepted {accepted[spec]:.2f}")
            continue
        ratios = [a / b for a, b in zip(rates[first], rates[spec])]  # first arm over this arm, per block
        m, sd = statistics.mean(ratios), statistics.stdev(ratios)
        half = t95(len(ratios) - 1) * sd / math.sqrt(len(ratios))
        summary["ratios"][spec] = {"mean": m, "low": m - half, "high": m + half}
        verdict = "ahead" if m - half > 1 else "behind" if m + half < 1 else "within noise"
        lines.append(f"{spec:<16} {mean_rate:>9.1f} {m:>17.3f}x {m - half:>7.3f}-{m + half:.3f}  {first} {verdict}"
                     f", accepted {accepted[spec]:.2f}")
    lines.append("rounds per arm: share drafted / planned, drafts verified / accepted per row, mean round ms "
                 "(its drafting / scheduling / target pass parts), mean width drafted")
    summary["accounting"] = {}
    for arm in arms:
        acc = summary["accounting"][arm.spec] = arm.accounting()
        if acc:
            lines.append(f"{arm.spec:<16} {acc['rounds']:>6d} rounds, drafted {acc['drafted']:.2f} planned "
                         f"{acc['planned']:.2f}, verified {acc['verified_per_row']:.2f} accepted "
                         f"{acc['accepted_per_row']:.2f} per row, round {acc['round_ms']:.1f} ms "
                         f"({acc['draft_ms']:.1f} / {acc['schedule_ms']:.2f} / {acc['target_ms']:.1f}), "
                         f"width {acc['draft_width']:.1f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_report(args.out, text, summary)
    return 0


def write_report(path: str | Path, text: str, data: dict) -> None:
    """Write a benchmark's text report to `path` and its data as JSON beside it (same name, .json)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, text + "\n")
    write_text_atomic(out.with_suffix(".json"), json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
