"""How much DSpark's sequential head adds to a decoding round, measured side by side.

    python benchmarks/head_overhead.py [--drafter dspark] [--rounds 60] [--batch 1] [--bias-candidates K] [--no-markov-table]

Runs the same prompts through the drafter with its Markov/RNN and confidence heads, and through the same
backbone with the heads removed (plain DFlash drafting), alternating, temperature 1, and reports
the mean time of a full round (draft + verify) and of the drafting step alone, in steady state: an
untimed warm-up on prose prompts first fills the Markov bias table.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from dspark.api import encode_prompt, load_drafter, load_target
from dspark.evaluation.bench import load_eval_prompts
from dspark.sampling import BatchSampling, SamplingParams


def time_rounds(target, drafter, prompts: list[list[int]], rounds: int) -> tuple[float, float]:
    """Median seconds of (propose) and (propose + verify forward) over `rounds` rounds on a batch of prompts."""
    from dspark.drafters.base import RoundOutcome

    batch = len(prompts)
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0)] * batch, target.device)
    gens = [torch.Generator().manual_seed(i) for i in range(batch)]
    target.reset(batch)
    target.set_feature_layers(drafter.feature_layers)
    drafter.start(prompts, target.forward([p[:-1] for p in prompts], features=True).features)
    seqs = [list(p) for p in prompts]
    t_draft, t_round = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        block = drafter.propose(seqs, sampling, gens)
        t1 = time.perf_counter()
        out = target.forward([[s[-1]] + block.tokens[r].tolist() for r, s in enumerate(seqs)], features=True)
        t2 = time.perf_counter()
        # commit the target's argmax after each anchor so both arms see the same text
        nxt = out.logits[:, 0].argmax(-1).tolist()
        target.truncate(target.lengths - block.tokens.shape[1])
        drafter.observe(RoundOutcome(committed=[[t] for t in nxt], accepted=[0] * batch, features=out.features))
        for s, t in zip(seqs, nxt):
            s.append(t)
        t_draft.append(t1 - t0)
        t_round.append(t2 - t0)
    return statistics.median(t_draft), statistics.median(t_round)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--drafter", default="dspark")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=4, help="repetitions (batches of prompts)")
    parser.add_argument("--batch", type=int, default=1, help="requests per round")
    parser.add_argument("--bias-candidates", type=int, default=None,
                        help="Markov bias on each slot's top-K base logits only (BlockDrafter.bias_candidates)")
    parser.add_argument("--no-markov-table", action="store_true",
                        help="compute the Markov bias as W1[x]·W2ᵀ per slot instead of reading the precomputed V×V table")
    args = parser.parse_args()
    target = load_target()
    with_head = load_drafter(args.drafter, target)
    with_head.bias_candidates = args.bias_candidates
    with_head.markov_table = with_head.markov_table and not args.no_markov_table
    without = copy.copy(with_head)
    without.model = copy.deepcopy(with_head.model)
    without.model.markov_head = None
    without.model.confidence_head = None
    rows = {"with heads": [], "without heads": []}
    texts = load_eval_prompts("code", args.prompts * args.batch)
    warm = [encode_prompt(target, t) for t in load_eval_prompts("prose", args.batch)]
    for d in (with_head, without):  # steady state: fills the Markov bias table (BlockDrafter.markov_table)
        time_rounds(target, d, warm, args.rounds)
    for i in range(args.prompts):
        batch = [encode_prompt(target, t) for t in texts[i * args.batch : (i + 1) * args.batch]]
        for name, d in (("with heads", with_head), ("without heads", without)):
            rows[name].append(time_rounds(target, d, batch, args.rounds))
    print(f"command: python benchmarks/head_overhead.py --drafter {args.drafter} --rounds {args.rounds} --batch {args.batch} "
          f"--prompts {args.prompts}" + (f" --bias-candidates {args.bias_candidates}" if args.bias_candidates else "")
          + (" --no-markov-table" if args.no_markov_table else ""))
    base_d = statistics.mean(r[0] for r in rows["without heads"])
    base_r = statistics.mean(r[1] for r in rows["without heads"])
    for name, vals in rows.items():
        d = statistics.mean(v[0] for v in vals)
        r = statistics.mean(v[1] for v in vals)
        print(f"{name:<14} draft {d * 1000:.2f} ms ({d / base_d:.3f}x)   round {r * 1000:.2f} ms ({r / base_r:.3f}x)")


if __name__ == "__main__":
    main()
