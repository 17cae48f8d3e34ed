"""Does a context-aware sequential head beat the vanilla Markov head on a trained backbone?

    python benchmarks/head_capacity.py --data data/regen/all.jsonl --eval data/heldout/code_t1.jsonl \
        data/heldout/prose_t1.jsonl [--drafter dspark] [--steps 300] [--lr 3e-4]

The backbone, embedding and LM head of a trained DSpark drafter stay frozen; only the sequential head
trains, on the same batches, for the same steps, from the trained vanilla head:

* `vanilla`: the head as it is (bias W2·W1[x_{k−1}]), trained further: the control;
* `gated`:   bias W2·(2σ(G[h_k; W1[x_{k−1}]]) ⊙ W1[x_{k−1}]) with G zero at the start, so it starts
  as the vanilla head exactly and may learn to scale each rank direction by the slot's context;
* `rnn`:     the vanilla bias plus W3·tanh(o_k) from a gated recurrent state over
  [s_{k−1}; W1[x_{k−1}]; h_k] (paper eq. 6, rank `--rnn-rank`), W3 zero at the start: it sees every
  earlier draft of the block, not only the last one.

Before and after, the script reports the teacher-forced expected acceptance per slot (Σ min(p, q)
against the target's temperature-1 distribution) on the held-out rows of each `--eval` file.
"""
from __future__ import annotations

import argparse
import copy
import math

import torch
from torch import nn

from draft_sharpness import expected_acceptance
from dspark.api import load_drafter, load_target
from dspark.training.block_objective import block_drafter_loss
from dspark.training.data import global_batches, load_sequences, training_sequences
from dspark.training.losses import LossWeights


class GatedFromVanilla(nn.Module):
    """A vanilla Markov head plus a per-rank-direction gate 2σ(G[h; W1[x]]) that starts at exactly 1."""

    def __init__(self, vanilla: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.markov_w1, self.markov_w2 = vanilla.markov_w1, vanilla.markov_w2
        rank = vanilla.markov_w1.weight.shape[1]
        self.gate = nn.Linear(hidden_size + rank, rank)
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.gate.bias)

    def block_bias(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:  # noqa: D102
        e = self.markov_w1(prev)
        return self.markov_w2(2 * torch.sigmoid(self.gate(torch.cat([h, e.to(h.dtype)], -1))) * e)


class RecurrentFromVanilla(nn.Module):
    """A vanilla Markov head plus a recurrent residual bias that starts at exactly 0."""

    def __init__(self, vanilla: nn.Module, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1, self.markov_w2 = vanilla.markov_w1, vanilla.markov_w2
        self.rank = rank
        self.joint = nn.Linear(rank + vanilla.markov_w1.weight.shape[1] + hidden_size, 3 * rank)
        self.out = nn.Linear(rank, vanilla.markov_w2.weight.shape[0], bias=False)
        nn.init.zeros_(self.out.weight)

    def block_bias(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:  # noqa: D102
        e = self.markov_w1(prev)
        state = torch.zeros(*h.shape[:-2], self.rank, dtype=h.dtype)
        outs = []
        for k in range(h.shape[-2]):
            g, c, o = self.joint(torch.cat([state, e[..., k, :], h[..., k, :]], -1)).chunk(3, -1)
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
            outs.append(torch.tanh(o))
        return self.markov_w2(e) + self.out(torch.stack(outs, -2))


def train_head(drafter, target, sequences, steps: int, lr: float, seed: int = 42) -> None:
    """Train only drafter.model.markov_head's parameters (the rest frozen) on `steps` batches of 8."""
    model = drafter.model
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(model.markov_head.parameters())
    for p in params:
        p.requires_grad_(True)
    model.train()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    weights = LossWeights(0.1, 0.9, 0.0, 4.0)
    batches = global_batches(len(sequences), 8, seed)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        idx = next(batches)
        losses = []
        for i, j in enumerate(idx):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 8 + i)
            out = block_drafter_loss(model, target.model, *sequences[j], gen, 64, weights)
            if out is not None:
                losses.append(out[0])
        loss = torch.stack(losses).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % 50 == 0:
            print(f"    step {step + 1}: loss {loss.item():.4f}", flush=True)
    model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--eval", nargs="+", required=True)
    parser.add_argument("--drafter", default="dspark")
    parser.add_argument("--variants", nargs="+", default=["vanilla", "gated"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--rnn-rank", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    target = load_target(dtype="float32")
    base = load_drafter(args.drafter, target)
    base.model.float()
    sequences = training_sequences(args.data)
    evals = {path: [r for r in load_sequences(path) if int(r[1].sum()) >= 16][: args.rows] for path in args.eval}
    print(f"command: python benchmarks/head_capacity.py --data {args.data} --eval {' '.join(args.eval)} "
          f"--drafter {args.drafter} --variants {' '.join(args.variants)} --steps {args.steps} --lr {args.lr} "
          f"--rows {args.rows} --rnn-rank {args.rnn_rank}")

    def report(label: str, drafter) -> None:
        for path, rows in evals.items():
            acc = expected_acceptance(drafter, target.model, rows)[0]
            print(f"  {label:18s} {path}: mean {float(acc.mean()):.4f}  " + " ".join(f"{a:.3f}" for a in acc.tolist()),
                  flush=True)

    report("before", base)
    for variant in args.variants:
        drafter = copy.deepcopy(base)
        if variant == "gated":
            drafter.model.markov_head = GatedFromVanilla(drafter.model.markov_head, drafter.cfg.hidden_size)
        elif variant == "rnn":
            drafter.model.markov_head = RecurrentFromVanilla(drafter.model.markov_head, drafter.cfg.hidden_size,
                                                             args.rnn_rank)
        print(f"{variant}: training the head for {args.steps} steps", flush=True)
        train_head(drafter, target, sequences, args.steps, args.lr)
        report(f"after ({variant})", drafter)


if __name__ == "__main__":
    main()
