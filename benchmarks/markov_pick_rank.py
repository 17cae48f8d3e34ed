"""How far the Markov bias moves a DSpark drafter's greedy pick away from its backbone's ranking.

    python benchmarks/markov_pick_rank.py [--drafters dspark PATH ...] [--prompts 8] [--k 64]

For the first `prompts` held-out prompts of code and prose, one block is drafted greedily after the
prompt (the full-vocabulary bias, as in decoding). For each slot it reports the rank of the chosen
token among the base (backbone) logits, how often that rank is K or worse (the pick lies outside the
top-K base candidates that `--bias-candidates K` keeps), and the mass of the drafting distribution
softmax(base + bias) outside those K candidates.
"""
from __future__ import annotations

import argparse

import torch

from dspark.api import encode_prompt, load_drafter, load_target
from dspark.evaluation.bench import load_eval_prompts


@torch.no_grad()
def pick_ranks(target, drafter, prompts: list[list[int]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slot of one greedy block after each prompt: the base-logit rank of the pick and the
    drafting mass outside the top-k base logits."""
    w1, w2t = drafter._markov_weights()
    ranks, outside = [], []
    for ids in prompts:
        target.reset(1)
        target.set_feature_layers(drafter.feature_layers)
        drafter.start([ids], target.forward([ids[:-1]], features=True).features)
        base = drafter.lm_head(drafter.block_hidden([ids]).transpose(0, 1)).float()  # [γ, 1, V]
        prev = torch.tensor([ids[-1]])
        for slot in base:
            full = slot + w1[prev] @ w2t
            pick = full.argmax(-1)
            ranks.append(int((slot > slot[0, pick]).sum()))
            top = slot[0].topk(k).indices
            outside.append(1.0 - float(full[0].softmax(-1)[top].sum()))
            prev = pick
    return torch.tensor(ranks, dtype=torch.float), torch.tensor(outside)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--drafters", nargs="+", default=["dspark"])
    parser.add_argument("--prompts", type=int, default=8, help="per domain (code, prose)")
    parser.add_argument("--k", type=int, default=64)
    args = parser.parse_args()
    target = load_target()
    prompts = [encode_prompt(target, p) for d in ("code", "prose") for p in load_eval_prompts(d, args.prompts)]
    print(f"command: python benchmarks/markov_pick_rank.py --drafters {' '.join(args.drafters)} "
          f"--prompts {args.prompts} --k {args.k}")
    for name in args.drafters:
        drafter = load_drafter(name, target)
        ranks, outside = pick_ranks(target, drafter, prompts, args.k)
        print(f"{name}: rank {drafter.cfg.markov_rank}, {len(ranks)} slots; greedy pick's base-logit rank median "
              f"{ranks.median():.0f}, outside the top {args.k} {float((ranks >= args.k).float().mean()):.2f}; "
              f"drafting mass outside the top {args.k}: {float(outside.mean()):.2f}")


if __name__ == "__main__":
    main()
