"""Where a speculative round's time goes, in units of one target-only decoding step.

    python benchmarks/round_breakdown.py [--drafter dspark] [--domain code] [--prompts 10] [--max-new-tokens 128]

Decodes the same held-out prompts at batch 1, greedy, target-only and with the drafter, timing each
part of the loop (the prompt's prefill, amortized over the rounds; the verify passes; propose; verify;
cache rollback; drafter update; the rest). Then a
second experiment interleaves verify-sized target forwards with and without a drafting call right
before them: if the forward is slower right after drafting, the drafter's memory traffic is evicting
the target's weights from the CPU caches.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

import dspark.decoding as decoding
from dspark.api import encode_prompt, load_drafter, load_target
from dspark.evaluation.bench import load_eval_prompts
from dspark.sampling import BatchSampling, SamplingParams
from dspark.target import CausalLM


class PartTimer:
    """Accumulates wall time of wrapped callables by label."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self._undo: list = []

    def wrap(self, owner, attr: str, label: str) -> None:
        """Time every call of owner.attr under `label` until `restore`."""
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    def wrap_target_forward(self) -> None:
        """Time CausalLM.forward as 'target prefill' (first pass after a reset) or 'target verify'."""
        reset, forward = CausalLM.reset, CausalLM.forward
        fresh = {"flag": False}

        def timed_reset(lm, *args, **kwargs):
            fresh["flag"] = True
            return reset(lm, *args, **kwargs)

        def timed_forward(lm, *args, **kwargs):
            label = "target prefill" if fresh["flag"] else "target verify"
            fresh["flag"] = False
            start = time.perf_counter()
            try:
                return forward(lm, *args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start

        CausalLM.reset, CausalLM.forward = timed_reset, timed_forward
        self._undo += [(CausalLM, "reset", reset), (CausalLM, "forward", forward)]

    def restore(self) -> None:
        """Put the original callables back."""
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()


def time_decoding(target, drafter, prompts, max_new_tokens: int) -> tuple[float, int, int, dict[str, float]]:
    """(seconds, rounds, tokens, seconds per part) of decoding every prompt alone."""
    timer = PartTimer()
    timer.wrap_target_forward()
    timer.wrap(CausalLM, "truncate", "cache rollback")
    timer.wrap(decoding, "verify", "verify")
    timer.wrap(type(drafter), "propose", "propose")
    timer.wrap(type(drafter), "observe", "drafter update")
    try:
        start = time.perf_counter()
        results = [decoding.decode(target, drafter, [p], max_new_tokens=max_new_tokens)[0] for p in prompts]
        total = time.perf_counter() - start
    finally:
        timer.restore()
    rounds = sum(len(r.rounds) for r in results)
    tokens = sum(len(r.token_ids) for r in results)
    return total, rounds, tokens, dict(timer.seconds)


def cache_experiment(target, drafter, prompt: list[int], width: int, reps: int = 200) -> tuple[float, float]:
    """Median ms of a `width`-token target forward alone and right after a drafting call."""
    target.set_feature_layers(drafter.feature_layers)
    target.reset(1)
    drafter.start([prompt], target.forward([prompt[:-1]], features=bool(drafter.feature_layers)).features)
    sampling = BatchSampling.from_params([SamplingParams()], target.device)
    alone, after = [], []
    for i in range(reps):
        if i % 2:
            drafter.propose([prompt], sampling, [None])
        start = time.perf_counter()
        target.forward([prompt[-width:]], features=bool(drafter.feature_layers))
        (after if i % 2 else alone).append(time.perf_counter() - start)
        target.truncate(target.lengths - width)
    return 1000 * statistics.median(alone), 1000 * statistics.median(after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--drafter", default="dspark")
    parser.add_argument("--domain", default="code")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target = load_target()
    drafter = load_drafter(args.drafter, target)
    none = load_drafter("none", target)
    prompts = [encode_prompt(target, t) for t in load_eval_prompts(args.domain, args.prompts)]
    for d in (none, drafter):  # warm-up
        decoding.decode(target, d, prompts[:1], max_new_tokens=16)
    base_s, _, base_tokens, _ = time_decoding(target, none, prompts, args.max_new_tokens)
    step_ms = 1000 * base_s / base_tokens
    total, rounds, tokens, parts = time_decoding(target, drafter, prompts, args.max_new_tokens)
    round_ms = 1000 * total / rounds
    print(f"command: python benchmarks/round_breakdown.py --drafter {args.drafter} --domain {args.domain} "
          f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens}")
    print(f"target-only step {step_ms:.2f} ms; {args.drafter}: tau {tokens / rounds:.2f}, round {round_ms:.2f} ms "
          f"= {round_ms / step_ms:.2f} steps, speedup {step_ms * tokens / rounds / round_ms:.2f}x")
    parts["the rest"] = total - sum(parts.values())
    for label, seconds in parts.items():
        ms = 1000 * seconds / rounds
        print(f"  {label:<15} {ms:6.2f} ms/round = {ms / step_ms:.3f} steps")
    width = getattr(drafter, "gamma", 7) + 1
    alone, after = cache_experiment(target, drafter, prompts[0], width)
    print(f"{width}-token target forward: {alone:.2f} ms alone, {after:.2f} ms right after drafting "
          f"({after / alone:.2f}x)")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
