"""How much DSpark's sequential head adds to a decoding round, measured side by side.

    python benchmarks/head_overhead.py [--drafter zoo/dspark] [--rounds 200]

Runs the same prompts through the drafter with its Markov/RNN and confidence heads, and through the same
backbone with the heads removed (plain DFlash drafting), alternating, batch 1, temperature 1, and reports
the mean time of a full round (draft + verify) and of the drafting step alone.
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


def time_rounds(target, drafter, prompt_ids: list[int], rounds: int) -> tuple[float, float]:
    """Median seconds of (propose) and (propose + verify forward) over `rounds` rounds on one prompt."""
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0)], target.device)
    gens = [torch.Generator().manual_seed(0)]
    target.reset(1)
    target.set_feature_layers(drafter.feature_layers)
    drafter.start([prompt_ids], target.forward([prompt_ids[:-1]], features=True).features)
    seq = list(prompt_ids)
    t_draft, t_round = [], []
    from dspark.drafters.base import RoundOutcome

    for _ in range(rounds):
        t0 = time.perf_counter()
        block = drafter.propose([seq], sampling, gens)
        t1 = time.perf_counter()
        out = target.forward([[seq[-1]] + block.tokens[0].tolist()], features=True)
        t2 = time.perf_counter()
        # commit the target's argmax after the anchor so both arms see the same text
        nxt = int(out.logits[0, 0].argmax())
        target.truncate(target.lengths - block.tokens.shape[1])
        drafter.observe(RoundOutcome(committed=[[nxt]], accepted=[0], features=out.features))
        seq.append(nxt)
        t_draft.append(t1 - t0)
        t_round.append(t2 - t0)
    return statistics.median(t_draft), statistics.median(t_round)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--drafter", default="dspark")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()
    target = load_target()
    with_head = load_drafter(args.drafter, target)
    without = copy.copy(with_head)
    without.model = copy.deepcopy(with_head.model)
    without.model.markov_head = None
    without.model.confidence_head = None
    rows = {"with heads": [], "without heads": []}
    for text in load_eval_prompts("code", args.prompts):
        ids = encode_prompt(target, text)
        for name, d in (("with heads", with_head), ("without heads", without)):
            rows[name].append(time_rounds(target, d, ids, args.rounds))
    print(f"command: python benchmarks/head_overhead.py --drafter {args.drafter} --rounds {args.rounds}")
    base_d = statistics.mean(r[0] for r in rows["without heads"])
    base_r = statistics.mean(r[1] for r in rows["without heads"])
    for name, vals in rows.items():
        d = statistics.mean(v[0] for v in vals)
        r = statistics.mean(v[1] for v in vals)
        print(f"{name:<14} draft {d * 1000:.2f} ms ({d / base_d:.3f}x)   round {r * 1000:.2f} ms ({r / base_r:.3f}x)")


if __name__ == "__main__":
    main()
