"""Acceptance statistics over decoding rounds: τ, histograms, per-position acceptance."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

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
