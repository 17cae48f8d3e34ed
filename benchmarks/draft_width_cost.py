"""What a drafted slot costs: the sampling kernel, and the bundled DSpark drafter's call by drafted width.

    python benchmarks/draft_width_cost.py [--batches 1 4 16 32 64] [--temperatures 0 1] [--reps 12]
        [--out benchmarks/results/draft_width_cost.txt]

1. Sampling one slot of R rows from a vocabulary of V = 8192, γ = 7 slots, each row from its own generator:
   Gumbel-max (V uniforms per row and slot, the block drafter's method before inverse-CDF sampling; kept here as
   the reference) against inverse-CDF sampling (`dspark.sampling.row_uniforms` + `sample_inverse_cdf`: one
   uniform per row and slot, a float64 cumulative sum). Both include the slot's softmax (its q).
2. The bundled DSpark drafter's `propose` at each drafted width w = 1..γ (`Drafter.draft_limit`), at each batch
   size: B requests join the engine and decode a few rounds, then the same drafting call is timed at every
   width, the widths taking turns (ascending, then descending), median milliseconds. The slope in w is what a
   drafted slot costs a step: what `CostModel.draft_slot` prices when a policy chooses its drafted width.

Ratios and slopes, not absolute times, carry over between runs on a noisy 2-core machine.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark.atomic import write_text_atomic
from dspark.sampling import BatchSampling, SamplingParams, row_uniforms, sample_inverse_cdf


def _gumbel_block(logits: torch.Tensor, gens: list[torch.Generator], slots: int) -> None:
    rows, vocab = logits.shape
    noise = torch.empty(slots, rows, vocab)
    for r in range(rows):
        u = torch.rand((slots, vocab), generator=gens[r])
        noise[:, r].copy_(u.log_().neg_().log_().neg_())
    for k in range(slots):
        torch.softmax(logits, -1)
        (noise[k] + logits).argmax(-1)


def _inverse_cdf_block(logits: torch.Tensor, gens: list[torch.Generator], slots: int) -> None:
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0)] * logits.shape[0], "cpu")
    u = row_uniforms(slots, sampling, gens, "cpu")
    for k in range(slots):
        sample_inverse_cdf(torch.softmax(logits, -1), u[:, k])


def sampling_kernels(batches: list[int], vocab: int, slots: int, reps: int) -> list[str]:
    lines = [f"## sampling {slots} slots, V = {vocab}: ms per block (median of {reps})",
             "rows  gumbel-max  inverse-cdf  ratio"]
    for rows in batches:
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 3
        gens = [torch.Generator().manual_seed(i) for i in range(rows)]
        times: dict[str, list[float]] = {"gumbel": [], "icdf": []}
        for rep in range(reps + 2):
            for name, fn in ((("gumbel", _gumbel_block), ("icdf", _inverse_cdf_block)) if rep % 2 == 0
                             else (("icdf", _inverse_cdf_block), ("gumbel", _gumbel_block))):
                start = time.perf_counter()
                fn(logits, gens, slots)
                if rep >= 2:
                    times[name].append(time.perf_counter() - start)
        g, i = (statistics.median(times[n]) * 1e3 for n in ("gumbel", "icdf"))
        lines.append(f"{rows:4d}  {g:10.2f}  {i:11.2f}  {g / i:5.1f}x")
    return lines


def drafting_by_width(batches: list[int], temperatures: list[float], reps: int) -> list[str]:
    from dspark.api import encode_prompt, load_drafter, load_target
    from dspark.drafters.base import drafter_gamma
    from dspark.engine import Engine, EngineConfig, Request
    from dspark.evaluation.bench import load_eval_prompts
    from dspark.scheduling import Scheduler

    target = load_target()
    drafter = load_drafter("dspark", target)
    drafter.prepare()
    gamma = drafter_gamma(drafter)
    prompts = [encode_prompt(target, p) for d in ("code", "prose", "math") for p in load_eval_prompts(d, 30)]
    lines = [f"## the bundled DSpark drafter's call: ms by drafted width (median of {reps})",
             "T  rows  " + "  ".join(f"w={w:<4d}" for w in range(1, gamma + 1)) + "  ms/slot"]
    for temperature in temperatures:
        for b in batches:
            engine = Engine(target, drafter, Scheduler(f"fixed:{gamma}", gamma), None, EngineConfig(max_running=b))
            for i in range(b):
                engine.add(Request(prompts[i % len(prompts)], SamplingParams(temperature=temperature, seed=i),
                                   max_tokens=1000, ignore_eos=True))
            for _ in range(400):  # until every request runs (prefill is chunked), then a few rounds
                engine.step()
                if len(engine.running) == b:
                    break
            for _ in range(3):
                engine.step()
            batch = engine._round_inputs()
            times: dict[int, list[float]] = {w: [] for w in range(1, gamma + 1)}
            for rep in range(reps + 2):
                for w in (range(1, gamma + 1) if rep % 2 == 0 else range(gamma, 0, -1)):
                    drafter.draft_limit = w
                    start = time.perf_counter()
                    drafter.propose(batch.seqs, batch.sampling, batch.gens)
                    if rep >= 2:
                        times[w].append(time.perf_counter() - start)
            drafter.draft_limit = None
            med = [statistics.median(times[w]) * 1e3 for w in range(1, gamma + 1)]
            slope = (med[-1] - med[0]) / max(1, gamma - 1)
            lines.append(f"{temperature:g}  {len(batch.rows):4d}  " + "  ".join(f"{m:6.2f}" for m in med)
                         + f"  {slope:7.2f}")
            for req in list(engine.running):
                engine.cancel(req.request_id)
            while engine.has_work:
                engine.step()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--slots", type=int, default=7)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--skip-drafter", action="store_true", help="only the sampling kernels")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    lines = [f"# python {' '.join(sys.argv)}", *sampling_kernels(args.batches, args.vocab, args.slots, args.reps)]
    print("\n".join(lines), flush=True)
    if not args.skip_drafter:
        more = drafting_by_width(args.batches, args.temperatures, args.reps)
        print("\n".join(more), flush=True)
        lines += [""] + more
    if args.out is not None:
        write_text_atomic(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
