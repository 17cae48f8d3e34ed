"""The drafter protocol: every drafting method proposes a `DraftBlock` for a batch of requests."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from dspark.sampling import BatchSampling


@dataclass
class DraftBlock:
    """Draft tokens for R requests.

    tokens: [R, γ] long (entries past lengths[r] are padding); lengths: [R] long, 0 allowed.
    probs: [R, γ, V] the distributions the drafts were sampled from, or None (one-hot q).
    confidences: [R, γ] predicted survival probability per position, or None.
    peaks: [R, γ] for greedy rows, max_x softmax(ℓ_k)(x) of the drafting logits ℓ_k at temperature 1 (NaN for
    sampled rows), or None. A greedy row's q is one-hot, so this is its drafter's only view of how sure it is;
    it is a function of q_k's logits, never of which token was drafted beyond that (non-anticipating).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    probs: torch.Tensor | None = None
    confidences: torch.Tensor | None = None
    peaks: torch.Tensor | None = None

    @classmethod
    def empty(cls, num_rows: int, device: torch.device | str = "cpu") -> "DraftBlock":
        """A block with no drafts for any request (a plain decoding round)."""
        return cls(
            tokens=torch.zeros(num_rows, 0, dtype=torch.long, device=device),
            lengths=torch.zeros(num_rows, dtype=torch.long, device=device),
        )

    @classmethod
    def from_lists(cls, drafts: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> "DraftBlock":
        """Pack ragged token lists into a padded block without probabilities."""
        width = max((len(d) for d in drafts), default=0)
        tokens = torch.zeros(len(drafts), width, dtype=torch.long)
        for r, d in enumerate(drafts):
            if len(d):
                tokens[r, : len(d)] = torch.as_tensor(list(d), dtype=torch.long)
        lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        return cls(tokens=tokens.to(device), lengths=lengths.to(device))

    def scatter(self, rows: Sequence[int], num_rows: int) -> "DraftBlock":
        """This block's rows placed at `rows` of a block of `num_rows` rows; the others draft nothing (length 0,
        zero probabilities, confidence 0.5, NaN peaks)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.lengths.device)

        def spread(t: torch.Tensor | None, fill: float) -> torch.Tensor | None:
            if t is None:
                return None
            out = torch.full((num_rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
            out[idx] = t
            return out

        return DraftBlock(spread(self.tokens, 0), spread(self.lengths, 0), spread(self.probs, 0.0),
                          spread(self.confidences, 0.5), spread(self.peaks, float("nan")))

    def truncate(self, max_lens: Sequence[int]) -> "DraftBlock":
        """Return the block with row r cut to at most max_lens[r] drafts."""
        cap = torch.as_tensor(list(max_lens), dtype=torch.long, device=self.lengths.device)
        return replace(self, lengths=torch.minimum(self.lengths, cap.clamp_min(0)))


@dataclass
class RoundOutcome:
    """What one verification round committed, fed back to the drafter.

    committed[r]: tokens appended to request r this round (accepted drafts + corrected/bonus token).
    accepted[r]: accepted draft count. features: target features [R, q, F] of the verify pass (anchor
    at position 0, then the drafts), or None when the drafter does not use target features.
    """

    committed: list[list[int]]
    accepted: list[int]
    features: torch.Tensor | None = None


class Drafter:
    """Base of all drafters. Subclasses implement `propose`; the hooks default to doing nothing.

    The engine calls `reset()` once, `join(prompts, prefill_features)` when new requests enter the batch
    (their rows go after the running ones), per step `propose`, the target verifies, `observe(outcome)`;
    `select(rows)` when finished requests leave the batch. `start` is `reset` then `join`. A round may skip
    `propose` (it is then observed all the same); a `propose` that raises leaves the state usable, and
    `propose_rows` (after a raising `propose`) drafts for some rows without changing any state.
    """

    name: str = "drafter"
    #: whether `propose` fills `DraftBlock.peaks` (off unless something reads them: the engine turns it on
    #: when it records signals or the drafter's calibration reads greedy rows' peaks)
    report_peaks: bool = False
    #: Target layer ids whose features the drafter reads; empty for drafters that don't see the target.
    feature_layers: tuple[int, ...] = ()
    #: the most drafts per row the next `propose` call can have verified (the engine sets it before each
    #: call: fixed:K verifies K at most, an adaptive policy the width it chose), or None for the whole block.
    #: Advisory: a drafter that can draft fewer slots for less work (the block drafters, EAGLE-3 and the draft
    #: model) returns a block of at most this many; others (n-gram lookup) may ignore it, since verification
    #: never reads drafts past what the scheduler admits.
    draft_limit: int | None = None

    def start(self, prompts: Sequence[Sequence[int]], prefill_features: torch.Tensor | None) -> None:
        """Begin a new batch whose requests start from `prompts`."""
        self.reset()
        self.join(prompts, prefill_features)

    def reset(self) -> None:
        """Drop every row."""

    def prepare(self) -> None:
        """Build now what the drafter would otherwise build lazily during its first drafting calls (caches of
        weight products), so that a server pays for it before it takes requests rather than in one step that
        stalls every stream. Drafting gives the same drafts with or without it."""

    def join(self, prompts: Sequence[Sequence[int]], prefill_features: torch.Tensor | None) -> None:
        """Append rows for requests starting from `prompts`, after the rows already in the batch.

        prefill_features[r, :len(prompts[r]) - 1]: the target features of every prompt token but the last.
        """

    def join_late(self, sequences: Sequence[Sequence[int]]) -> bool:
        """Append rows for requests already decoding (`sequences`: prompt + output so far, anchor last) whose
        target features were never captured, with a context that starts at the anchor. False (this default): the
        drafter cannot, and the engine leaves those rows without drafts."""
        return False

    def propose(
        self,
        sequences: Sequence[Sequence[int]],
        sampling: BatchSampling,
        generators: Sequence[torch.Generator],
    ) -> DraftBlock:
        """Return drafts continuing each sequence (prompt + generated tokens, anchor last)."""
        raise NotImplementedError

    def propose_rows(
        self,
        rows: Sequence[int],
        sequences: Sequence[Sequence[int]],
        sampling: BatchSampling,
        generators: Sequence[torch.Generator],
    ) -> DraftBlock:
        """Drafts for the batch rows `rows` alone (sequences, sampling and generators are theirs), leaving the
        drafter's state as it was before the call: how the engine finds the requests whose drafting raises.
        A drafter without it (this default) has a raising `propose` fail the whole step instead."""
        raise NotImplementedError

    def observe(self, outcome: RoundOutcome) -> None:
        """Learn what the last round accepted."""

    def select(self, rows: Sequence[int]) -> None:
        """Keep only the given rows of any per-request state."""


class NoDrafter(Drafter):
    """Target-only autoregressive decoding: every round verifies zero drafts."""

    name = "none"

    def propose(self, sequences, sampling, generators) -> DraftBlock:
        """Return an empty block."""
        return DraftBlock.empty(len(sequences))

    def propose_rows(self, rows, sequences, sampling, generators) -> DraftBlock:
        """Return an empty block (no state)."""
        return self.propose(sequences, sampling, generators)


def drafter_gamma(drafter: Drafter) -> int:
    """Drafts per round the drafter proposes at most (0 for target-only decoding)."""
    return int(getattr(drafter, "max_drafts", None) or getattr(drafter, "gamma", 0) or 0)
