"""Is a drafter's distribution too sharp or too flat? Teacher-forced expected acceptance vs draft temperature.

    python benchmarks/draft_sharpness.py DATA.jsonl [--drafters dspark eagle3] [--rows 40] [--scales 0.8 1 1.2 1.5]

DATA holds regenerated rows ({"prompt_ids", "answer_ids"}, e.g. `dspark regenerate` of held-out prompts
at temperature 1). For every answer position the target's temperature-1 distribution p is compared with
the drafter's q_s = softmax(logits / s) at each slot, teacher-forced on the row's tokens (the previous
tokens are the accepted ones, as in verification): the expected acceptance of a slot is Σ min(p, q_s) =
1 − TV(p, q_s). s = 1 is what decoding at temperature 1 drafts from; an optimum above 1 means the
drafter is overconfident. Block drafters use every answer position as an anchor (all γ slots), EAGLE-3
its training-time-test unroll (γ chained steps).
"""
from __future__ import annotations

import argparse
import json

import torch

from dspark.api import load_drafter, load_target
from dspark.drafters.block import BlockDrafter
from dspark.training.block_objective import block_logits, target_pass
from dspark.training.blocks import build_blocks
from dspark.training.data import load_sequences
from dspark.training.eagle3_objective import ttt_logits, ttt_targets


@torch.no_grad()
def slot_logits(drafter, target_model, ids: torch.Tensor, mask: torch.Tensor):
    """(draft logits [n, γ, V], target logits [n, γ, V], valid [n, γ]) teacher-forced over one row."""
    model = drafter.model
    feats, t_logits = target_pass(target_model, ids, model.cfg.target_layer_ids)
    if isinstance(drafter, BlockDrafter):
        m = mask.bool()
        anchors = (m[:-1] & m[1:]).nonzero().flatten()
        blocks = build_blocks(ids, mask, anchors, model.cfg.block_size, model.cfg.mask_token_id)
        logits, _ = block_logits(model, target_model, feats, blocks)
        return logits, t_logits[blocks.label_pos].float(), blocks.valid
    steps = ttt_logits(model, target_model, ids, feats, model.cfg.ttt_length)
    d, t, v = [], [], []
    for j, lg in enumerate(steps):
        tok_idx, valid = ttt_targets(mask, j)
        d.append(lg)
        t.append(t_logits[tok_idx].float())
        v.append(valid)
    return torch.stack(d, 1), torch.stack(t, 1), torch.stack(v, 1)


@torch.no_grad()
def expected_acceptance(drafter, target_model, rows, scales=(1.0,)) -> torch.Tensor:
    """Mean Σ min(p, softmax(logits / s)) per draft temperature scale s and slot [len(scales), γ]."""
    sums, counts = 0.0, 0.0
    for ids, mask in rows:
        d, t, valid = slot_logits(drafter, target_model, ids, mask)
        p = torch.softmax(t, -1)
        per = torch.stack([torch.minimum(p, torch.softmax(d / s, -1)).sum(-1) for s in scales])  # [S, n, γ]
        sums = sums + (per * valid.float()).sum(1)
        counts = counts + valid.float().sum(0)
    return sums / counts.clamp_min(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("data")
    parser.add_argument("--drafters", nargs="+", default=["dspark", "eagle3"])
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--scales", type=float, nargs="+", default=[0.8, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5])
    args = parser.parse_args()
    target = load_target(dtype=args.dtype)
    rows = [r for r in load_sequences(args.data) if int(r[1].sum()) >= 16][: args.rows]
    print(f"command: python benchmarks/draft_sharpness.py {args.data} --drafters {' '.join(args.drafters)} "
          f"--rows {args.rows} --scales {' '.join(map(str, args.scales))}")
    result = {}
    for name in args.drafters:
        acc = expected_acceptance(load_drafter(name, target), target.model, rows, args.scales)  # [S, γ]
        result[name] = {"scales": args.scales, "acceptance": acc.tolist()}
        print(f"\n{name}: expected acceptance per slot (teacher-forced), by draft temperature scale")
        for s, row in zip(args.scales, acc):
            print(f"  s={s:<5} mean {float(row.mean()):.4f}  " + " ".join(f"{a:.3f}" for a in row.tolist()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
