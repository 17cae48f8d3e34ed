"""Acceptance statistics over decoding rounds: τ, histograms, per-position acceptance."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from dspark.decoding import RoundStats


@dataclass
class AcceptanceStats:
    """Aggregated over rounds. τ counts the bonus token: τ = committed tokens / rounds.

    histogram[j]: rounds that accepted exactly j drafts. cumulative[k-1]: P(drafts 1..k all accepted |
    at least k drafted) (vLLM's per-position vector). conditional[k-1]: P(draft k accepted | drafts
    1..k-1 accepted and at least k drafted) (the paper's Fig. 2).
    """

    rounds: int
    tokens: int
    histogram: list[int]
    cumulative: list[float]
    conditional: list[float]

    @property
    def tau(self) -> float:
        """Mean committed tokens per round (bonus included)."""
        return self.tokens / max(1, self.rounds)


def acceptance_stats(rounds: Iterable[RoundStats], tokens: int) -> AcceptanceStats:
    """Return the acceptance statistics of a list of rounds that committed `tokens` tokens in all."""
    rounds = list(rounds)
    longest = max((r.draft_len for r in rounds), default=0)
    hist = [0] * (longest + 1)
    for r in rounds:
        hist[r.accepted] += 1
    cumulative, conditional = [], []
    for k in range(1, longest + 1):
        offered = [r for r in rounds if r.draft_len >= k]
        reached = [r for r in offered if r.accepted >= k - 1]
        passed = [r for r in offered if r.accepted >= k]
        cumulative.append(len(passed) / max(1, len(offered)))
        conditional.append(len(passed) / max(1, len(reached)))
    return AcceptanceStats(len(rounds), tokens, hist, cumulative, conditional)


def tau_standard_error(tokens: Sequence[int], rounds: Sequence[int]) -> float:
    """Standard error of τ = Σ tokens / Σ rounds over independent prompts (ratio estimator, delta method).

    Prompts, not rounds, are the independent units: rounds of one answer share its difficulty. NaN below
    two prompts.
    """
    if len(tokens) != len(rounds):
        raise ValueError(f"tokens and rounds differ in length: {len(tokens)} vs {len(rounds)}")
    n, total_rounds = len(tokens), sum(rounds)
    if n < 2 or total_rounds == 0:
        return math.nan
    tau = sum(tokens) / total_rounds
    squares = sum((t - tau * r) ** 2 for t, r in zip(tokens, rounds))
    return math.sqrt(n / (n - 1) * squares) / total_rounds


def macro_tau(per_domain: Mapping[str, tuple[Sequence[int], Sequence[int]]]) -> float:
    """Mean over domains of each domain's τ; `per_domain[d]` = (tokens per prompt, rounds per prompt)."""
    return sum(sum(t) / max(1, sum(r)) for t, r in per_domain.values()) / len(per_domain)


def paired_tau_ratio(
    a: Mapping[str, tuple[Sequence[int], Sequence[int]]],
    b: Mapping[str, tuple[Sequence[int], Sequence[int]]],
    draws: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Macro τ of `a` over macro τ of `b`, with a 95% paired bootstrap interval.

    Both are measured on the same prompts of the same domains; each draw resamples the prompts of every
    domain with replacement and takes the same prompts for both, so prompt difficulty cancels.
    Returns (ratio, low, high).
    """
    if set(a) != set(b):
        raise ValueError(f"the two runs cover different domains: {sorted(a)} vs {sorted(b)}")
    for d in a:
        if len(a[d][0]) != len(b[d][0]):
            raise ValueError(f"domain {d}: {len(a[d][0])} prompts vs {len(b[d][0])}; a paired ratio needs the same prompts")
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        ra, rb = {}, {}
        for d in a:
            idx = [rng.randrange(len(a[d][0])) for _ in a[d][0]]
            ra[d] = ([a[d][0][i] for i in idx], [a[d][1][i] for i in idx])
            rb[d] = ([b[d][0][i] for i in idx], [b[d][1][i] for i in idx])
        ratios.append(macro_tau(ra) / macro_tau(rb))
    ratios.sort()
    return macro_tau(a) / macro_tau(b), ratios[int(0.025 * draws)], ratios[min(draws - 1, int(0.975 * draws))]
