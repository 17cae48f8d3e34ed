"""Predicted per-slot acceptance of a block drafter on answers the target sampled at different settings.

    python benchmarks/sampling_shift.py [--drafter dspark] [--prompts 12] [--max-new-tokens 128]

The target answers held-out prompts (code and prose) at each sampling setting; on those texts the
drafter's analytic acceptance c*_k = 1 − ½‖p_draft − p_target‖₁ (temperature 1, teacher-forced block, 64
random anchors per answer) is averaged per slot. A drafter trained only on text sampled at one setting
shows how much it loses on text sampled at another (the temperature-1 prefixes of `dspark bench`).
"""
from __future__ import annotations

import argparse

import torch

from dspark.api import encode_prompt, load_drafter, load_target
from dspark.decoding import decode
from dspark.drafters.base import NoDrafter
from dspark.evaluation.bench import load_eval_prompts
from dspark.sampling import SamplingParams
from dspark.training.block_objective import block_drafter_loss
from dspark.training.losses import DSPARK_WEIGHTS

SETTINGS = [SamplingParams(0.0), SamplingParams(0.7, 20, 0.8), SamplingParams(1.0)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--drafter", default="dspark")
    parser.add_argument("--prompts", type=int, default=12, help="prompts per domain (code, prose)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target = load_target(None, "float32")
    model = load_drafter(args.drafter, target).model
    texts = load_eval_prompts("code", args.prompts) + load_eval_prompts("prose", args.prompts)
    prompts = [encode_prompt(target, t) for t in texts]
    print(f"command: python benchmarks/sampling_shift.py --drafter {args.drafter} --prompts {args.prompts} "
          f"--max-new-tokens {args.max_new_tokens}")
    for s in SETTINGS:
        params = [SamplingParams(s.temperature, s.top_k, s.top_p, seed=i) for i in range(len(prompts))]
        results = decode(target, NoDrafter(), prompts, params, args.max_new_tokens)
        rates = []
        for i, (p, r) in enumerate(zip(prompts, results)):
            ids = torch.tensor(p + r.token_ids)
            mask = torch.tensor([0] * len(p) + [1] * len(r.token_ids))
            with torch.no_grad():
                out = block_drafter_loss(model, target.model, ids, mask, torch.Generator().manual_seed(i), 64,
                                         DSPARK_WEIGHTS)
            if out is not None:
                rates.append(out[1]["accept_rate"])
        mean = torch.stack(rates).mean(0).tolist()
        print(f"answers sampled at T={s.temperature} top-k={s.top_k} top-p={s.top_p}: "
              f"predicted acceptance by slot {[round(a, 3) for a in mean]}")


if __name__ == "__main__":
    main()
