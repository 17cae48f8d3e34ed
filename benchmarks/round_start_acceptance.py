"""Expected acceptance of the first draft slot where rounds really start vs at every position.

    python benchmarks/round_start_acceptance.py [--drafters dspark eagle3] [--domain code] [--prompts 8]

Each prompt is decoded at temperature 1 with the drafter; every round records the drafting
distribution q of its first slot. The finished sequence is then run teacher-forced (block drafters:
every answer position as an anchor; EAGLE-3: its training-time-test step 0), which gives the q the
drafter would have used at each position. The script reports (1) the largest TV distance between the
q drafted in decoding and the teacher-forced q at the same position (decoding and training compute
the same drafter), and (2) the expected first-slot acceptance Σ min(p, q) averaged over round starts
and over all answer positions. Rounds start right after a rejection or a full block, so the two
averages differ when acceptance depends on the position.
"""
from __future__ import annotations

import argparse

import torch

from draft_sharpness import slot_logits
from dspark.api import encode_prompt, load_drafter, load_target
from dspark.decoding import decode
from dspark.drafters.block import BlockDrafter
from dspark.evaluation.bench import load_eval_prompts
from dspark.sampling import SamplingParams


@torch.no_grad()
def measure(target, name: str, prompts: list[list[int]], max_new_tokens: int) -> dict[str, float]:
    """Max TV(decoded q, teacher-forced q) and mean first-slot acceptance at round starts / everywhere."""
    drafter = load_drafter(name, target)
    starts: list[tuple[int, torch.Tensor]] = []
    propose = drafter.propose

    def recording(sequences, sampling, generators):
        block = propose(sequences, sampling, generators)
        starts.append((len(sequences[0]), block.probs[0, 0].clone()))
        return block

    drafter.propose = recording
    tv_max, at_starts, everywhere = 0.0, [], []
    for i, ids in enumerate(prompts):
        starts.clear()
        (res,) = decode(target, drafter, [ids], SamplingParams(temperature=1.0, seed=i), max_new_tokens)
        full = torch.tensor(ids + res.token_ids)
        mask = torch.tensor([0] * len(ids) + [1] * len(res.token_ids))
        mask[len(ids) - 1] = 1  # the last prompt token anchors the first round
        d_logits, t_logits, valid = slot_logits(drafter, target.model, full, mask)
        p = torch.softmax(t_logits[:, 0], -1)
        q = torch.softmax(d_logits[:, 0], -1)
        acc = torch.minimum(p, q).sum(-1)
        # row j of the teacher-forced slot 0 predicts the token at position first + j: block drafters'
        # anchors start at the last prompt token, EAGLE-3's step 0 row t predicts x_{t+2}
        first = len(ids) if isinstance(drafter, BlockDrafter) else 2
        everywhere.extend(acc[valid[:, 0]].tolist())
        for length, q_dec in starts:
            j = length - first
            if 0 <= j < len(acc) and bool(valid[j, 0]):
                tv_max = max(tv_max, 0.5 * float((q_dec - q[j]).abs().sum()))
                at_starts.append(float(acc[j]))
    return {"rounds": len(at_starts), "tv_max": tv_max, "at_round_starts": sum(at_starts) / len(at_starts),
            "all_positions": sum(everywhere) / len(everywhere)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--drafters", nargs="+", default=["dspark", "eagle3"])
    parser.add_argument("--domain", default="code")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target = load_target(dtype="float32")
    prompts = [encode_prompt(target, p) for p in load_eval_prompts(args.domain, args.prompts)]
    print(f"command: python benchmarks/round_start_acceptance.py --drafters {' '.join(args.drafters)} "
          f"--domain {args.domain} --prompts {args.prompts} --max-new-tokens {args.max_new_tokens}")
    for name in args.drafters:
        m = measure(target, name, prompts, args.max_new_tokens)
        print(f"{name}: {m['rounds']} rounds; max TV(decoded q, teacher-forced q) {m['tv_max']:.1e}; expected "
              f"slot-1 acceptance at round starts {m['at_round_starts']:.3f}, at all answer positions "
              f"{m['all_positions']:.3f}")


if __name__ == "__main__":
    main()
