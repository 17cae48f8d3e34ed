"""Classic speculative decoding with an independent small draft LM sharing the target's tokenizer."""
from __future__ import annotations

from typing import Sequence

import torch

from dspark.drafters.base import DraftBlock, Drafter
from dspark.sampling import BatchSampling, greedy_peaks, logits_to_probs
from dspark.target import CausalLM


class DraftModelDrafter(Drafter):
    """Drafts γ tokens autoregressively with a small LM; q is its own filtered sampling distribution.

    The draft keeps its own batched KV cache. Before each proposal it rolls every row back to the
    longest prefix it shares with the request's committed text, so accepted drafts are not recomputed.
    """

    name = "draft-model"

    def __init__(self, model: CausalLM, gamma: int = 4) -> None:
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.lm = model
        self.gamma = gamma
        self.fed: list[list[int]] = []

    def reset(self) -> None:
        """Drop every row of the draft cache."""
        self.lm.reset(0)
        self.fed = []

    def join(self, prompts, prefill_features) -> None:
        """Add empty draft-cache rows; the first proposal feeds each new row its prompt."""
        self.lm.add_rows(len(prompts))
        self.fed += [[] for _ in prompts]

    def select(self, rows: Sequence[int]) -> None:
        """Keep the cache rows of requests still running."""
        self.lm.select(rows)
        self.fed = [self.fed[r] for r in rows]

    def propose(self, sequences, sampling: BatchSampling, generators) -> DraftBlock:
        """Sample γ draft tokens per request from the draft model, returning their distributions.

        If it raises, the cache is emptied (what it holds is then unknown): the next call feeds every row anew.
        """
        try:
            return self._propose(sequences, sampling, generators)
        except BaseException:
            self.lm.reset(len(self.fed))
            self.fed = [[] for _ in self.fed]
            raise

    def propose_rows(self, rows, sequences, sampling: BatchSampling, generators) -> DraftBlock:
        """`propose` from an empty cache of the given rows (it feeds their whole text), the batch's untouched."""
        lm, fed = self.lm, self.fed
        self.lm, self.fed = lm.empty_like(), [[] for _ in rows]
        try:
            self.lm.reset(len(rows))
            return self.propose(sequences, sampling, generators)
        finally:
            self.lm, self.fed = lm, fed

    def _propose(self, sequences, sampling: BatchSampling, generators) -> DraftBlock:
        num_rows = len(sequences)
        keep = []
        pending = []
        for r, seq in enumerate(sequences):
            fed = self.fed[r]
            common = 0
            limit = min(len(fed), len(seq) - 1)  # always re-feed at least the anchor
            while common < limit and fed[common] == seq[common]:
                common += 1
            keep.append(common)
            pending.append(list(seq[common:]))
        self.lm.truncate(keep)
        self.fed = [list(seq) for seq in sequences]

        gamma = min(self.gamma, self.draft_limit or self.gamma)  # each slot is a forward pass: draft no more
        tokens = torch.zeros(num_rows, gamma, dtype=torch.long, device=self.lm.device)
        probs = peaks = None
        last = [len(p) - 1 for p in pending]
        for k in range(gamma):
            out = self.lm.forward(pending)
            logits = out.logits[torch.arange(num_rows), torch.tensor(last, device=out.logits.device)]
            q = logits_to_probs(logits.unsqueeze(1), sampling).squeeze(1)  # [R, V]
            peak = greedy_peaks(logits.unsqueeze(1), sampling.greedy) if self.report_peaks else None
            if peak is not None:
                peaks = peak if peaks is None else torch.cat([peaks, peak], 1)
            if probs is None:
                probs = torch.zeros(num_rows, gamma, q.shape[-1], device=q.device)
            probs[:, k] = q
            for r in range(num_rows):
                if bool(sampling.greedy[r]):
                    tokens[r, k] = q[r].argmax()
                else:
                    tokens[r, k] = torch.multinomial(q[r], 1, generator=generators[r]).squeeze()
            step = tokens[:, k].tolist()
            for r in range(num_rows):
                self.fed[r].append(step[r])
            pending = [[t] for t in step]
            last = [0] * num_rows
        # The last draft was never fed; drop it from the record of what the cache holds.
        for r in range(num_rows):
            self.fed[r].pop()
        lengths = torch.full((num_rows,), gamma, dtype=torch.long, device=self.lm.device)
        return DraftBlock(tokens=tokens, lengths=lengths, probs=probs, peaks=peaks)
