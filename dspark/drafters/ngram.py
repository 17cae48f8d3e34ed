"""Prompt-lookup (n-gram) drafting: copy what followed the latest earlier occurrence of the suffix."""
from __future__ import annotations

from typing import Sequence

from dspark.drafters.base import DraftBlock, Drafter
from dspark.sampling import BatchSampling


def lookup_continuation(tokens: Sequence[int], gamma: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Return up to `gamma` tokens that followed the most recent earlier match of the longest suffix n-gram.

    Tries n = max_n down to min_n; returns [] when no suffix of those lengths occurred before.
    """
    seq = list(tokens)
    size = len(seq)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        pattern = seq[size - n :]
        # scan right to left, excluding the suffix itself
        for start in range(size - n - 1, -1, -1):
            if seq[start : start + n] == pattern:
                follow = seq[start + n : start + n + gamma]
                if follow:
                    return follow
    return []


class NgramDrafter(Drafter):
    """Prompt lookup decoding (no model): drafts are one-hot, so q(x) = 1 in verification."""

    name = "ngram"

    def __init__(self, gamma: int = 4, min_n: int = 1, max_n: int = 3) -> None:
        if gamma < 1 or min_n < 1 or max_n < min_n:
            raise ValueError(f"bad n-gram settings gamma={gamma} min_n={min_n} max_n={max_n}")
        self.gamma, self.min_n, self.max_n = gamma, min_n, max_n

    def propose(self, sequences, sampling: BatchSampling, generators) -> DraftBlock:
        """Return the looked-up continuation of every sequence."""
        drafts = [lookup_continuation(s, self.gamma, self.min_n, self.max_n) for s in sequences]
        return DraftBlock.from_lists(drafts, device=sampling.temperature.device)

    def propose_rows(self, rows, sequences, sampling: BatchSampling, generators) -> DraftBlock:
        """As `propose` (the lookup keeps no state)."""
        return self.propose(sequences, sampling, generators)
