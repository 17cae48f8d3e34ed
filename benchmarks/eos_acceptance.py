"""Drafts accepted per round before and after the target's first EOS, when generation runs past it.

    python benchmarks/eos_acceptance.py [--drafter dspark] [--temperatures 1 0] [--prompts 10] [--max-tokens 128]
        [--out FILE]

Load benchmarks often ask for a fixed output length (vLLM's `ignore_eos`) so that every arm does the same work.
Past EOS a chat model writes text no user reads (new turns, repetition), and a drafter trained on answers
predicts it worse. This script decodes the held-out prompts of each domain at batch 1 with EOS ignored and
splits the drafted rounds by whether they start before or after the first EOS of the output, so a sweep's
figures can be read against what users see. Writes a text report (and its JSON beside it) with --out.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleaved_arms import write_report  # noqa: E402

from dspark.api import encode_prompt, load_drafter, load_target
from dspark.decoding import decode
from dspark.evaluation.bench import load_eval_prompts
from dspark.sampling import SamplingParams


def split_rounds(token_ids: list[int], rounds, eos_ids: set[int]) -> tuple[list[int], list[int]]:
    """Accepted drafts of the drafted rounds that start before / after the first EOS among `token_ids`.

    A request's first round is its prefill (it commits one token, verifies no drafts); every later round
    commits its accepted drafts plus one target token."""
    first_eos = next((j for j, t in enumerate(token_ids) if t in eos_ids), len(token_ids))
    before, after, pos = [], [], 0
    for r in rounds:
        if r.draft_len > 0:
            (before if pos < first_eos else after).append(r.accepted)
        pos += r.accepted + 1
    return before, after


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--temperatures", nargs="+", type=float, default=[1.0, 0.0])
    ap.add_argument("--prompts", type=int, default=10, help="held-out prompts per domain")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = load_target()
    drafter = load_drafter(args.drafter, target)
    eos = {target.tokenizer.eos_token_id}
    lines = [f"python benchmarks/eos_acceptance.py {' '.join(sys.argv[1:])}",
             f"drafter {args.drafter}, batch 1, {args.max_tokens} tokens with EOS ignored; drafts accepted per "
             f"drafted round (rounds) before / after the output's first EOS"]
    report: dict = {"args": vars(args), "cells": []}
    for temp in args.temperatures:
        all_before, all_after, to_eos = [], [], []
        for domain in ("code", "prose", "math"):
            before, after = [], []
            for i, text in enumerate(load_eval_prompts(domain, args.prompts)):
                ids = encode_prompt(target, text)
                (res,) = decode(target, drafter, [ids], SamplingParams(temperature=temp, seed=i), args.max_tokens,
                                eos_token_ids=frozenset())
                b, a = split_rounds(res.token_ids, res.rounds, eos)
                before += b
                after += a
                to_eos.append(next((j for j, t in enumerate(res.token_ids) if t in eos), len(res.token_ids)))
            cell = {"temperature": temp, "domain": domain,
                    "before": statistics.mean(before) if before else None, "rounds_before": len(before),
                    "after": statistics.mean(after) if after else None, "rounds_after": len(after)}
            report["cells"].append(cell)
            lines.append(f"T={temp:g} {domain:<6} before {_fmt(cell['before'])} ({len(before)}), "
                         f"after {_fmt(cell['after'])} ({len(after)})")
            all_before += before
            all_after += after
        ended = sum(n < args.max_tokens for n in to_eos)
        lines.append(f"T={temp:g} all    before {_fmt(statistics.mean(all_before) if all_before else None)} "
                     f"({len(all_before)}), after {_fmt(statistics.mean(all_after) if all_after else None)} "
                     f"({len(all_after)}); {ended} of {len(to_eos)} outputs reach EOS within {args.max_tokens} "
                     f"tokens (median position {statistics.median(to_eos):g})")
        report["cells"].append({"temperature": temp, "domain": "all",
                                "before": statistics.mean(all_before) if all_before else None,
                                "after": statistics.mean(all_after) if all_after else None,
                                "eos_positions": to_eos})
        print("\n".join(lines[-4:]), flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_report(args.out, text, report)
    return 0


def _fmt(x: float | None) -> str:
    return "  -  " if x is None else f"{x:.2f}"


if __name__ == "__main__":
    sys.exit(main())
