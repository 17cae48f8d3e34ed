"""The block drafters' context cache: projected target features (per draft layer K/V) of every row's accepted tokens.

Each draft layer's keys and values live in a `HeadroomLayer` (dspark.kv_cache), so the per-round append of a
round's accepted tokens, rows joining after their prefill and rows leaving write in place instead of copying the
whole cache: with `torch.cat` the cache of every row was copied on each of those, which at 64 rows of a few
hundred slots cost the engine about 10% of a step even in rounds that draft nothing.
"""
from __future__ import annotations

from typing import Sequence

import torch

from dspark.kv_cache import HeadroomLayer


class ContextCache:
    """Per-layer projected context K/V [R, KV, T, hd] for a batch of rows of different lengths (padding masked).

    `valid` [R, T] marks real slots and `lengths` [R] counts them; `offsets` [R] is the text position of each
    row's first context token (0, except for rows that joined late, whose context starts where they joined and
    holds nothing of the text before: `BlockDrafter.join_late`). `dense` is True while every slot of every row
    is real (always so for a batch of one), so attention needs no mask. Slack left by masked slots is compacted
    away once it exceeds `max(compact_slack, longest row // 2)`.
    """

    def __init__(self, compact_slack: int = 64) -> None:
        self.layers: list[HeadroomLayer] = []
        self.valid = torch.zeros(0, 0, dtype=torch.bool)
        self.lengths = torch.zeros(0, dtype=torch.long)
        self.offsets = torch.zeros(0, dtype=torch.long)
        self.compact_slack = compact_slack
        self.dense = True

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values), each [R, KV, T, hd]; empty before the first append."""
        return [(layer.keys, layer.values) for layer in self.layers]

    def rooms(self, extra: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values) [R, KV, T + extra, hd]: the context followed by `extra` scratch slots that a
        draft pass fills with its block's own keys and values (`HeadroomLayer.with_room`; kept no further)."""
        return [layer.with_room(extra) for layer in self.layers]

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]], counts: torch.Tensor) -> None:
        """Append per-layer K/V [R, KV, q, hd] of which the first counts[r] slots of row r are real."""
        q = kv[0][0].shape[2]
        new_valid = torch.arange(q, device=counts.device).view(1, -1) < counts.view(-1, 1)
        self.dense = (self.dense or not self.layers) and bool((counts == q).all())
        if not self.layers:
            self.layers = [HeadroomLayer.holding(k, v) for k, v in kv]
            self.valid = new_valid
            self.lengths = counts.clone()
            if self.offsets.shape != counts.shape:
                self.offsets = torch.zeros_like(counts)
        else:
            for layer, (k, v) in zip(self.layers, kv):
                layer.update(k, v)
            self.valid = torch.cat([self.valid, new_valid], 1)
            self.lengths = self.lengths + counts
        if self.valid.shape[1] - int(self.lengths.max()) > max(self.compact_slack, int(self.lengths.max()) // 2):
            self.compact()

    def compact(self) -> None:
        """Move each row's valid slots to the right end and drop unused slots (every row's context then ends at
        the cache's end, and attention over a short row starts far right: `dspark.attention`'s row segments)."""
        width = int(self.lengths.max())
        order = torch.argsort(self.valid.to(torch.int8), dim=1, stable=True)[:, self.valid.shape[1] - width:]
        for layer in self.layers:
            layer.gather_slots(order)
        self.valid = torch.arange(width, device=self.valid.device).view(1, -1) >= (width - self.lengths).view(-1, 1)
        self.dense = bool(self.valid.all())

    def extend(self, other: "ContextCache") -> None:
        """Append the rows of `other` after these rows, padding the narrower side's slots (masked): the joining
        rows on the left, so that their context ends at the cache's end; these rows on the right (in place)."""
        if not other.layers:
            return
        if not self.layers:
            self.layers, self.valid, self.lengths, self.dense = other.layers, other.valid, other.lengths, other.dense
            self.offsets = other.offsets
            return
        width = max(self.valid.shape[1], other.valid.shape[1])
        rows = int(other.lengths.shape[0])
        for mine, theirs in zip(self.layers, other.layers):
            mine.extend_rows(theirs.keys, theirs.values, rows, width, right=True)
        pad = torch.nn.functional.pad
        self.valid = torch.cat([pad(self.valid, (0, width - self.valid.shape[1])),
                                pad(other.valid, (width - other.valid.shape[1], 0))], 0)
        self.lengths = torch.cat([self.lengths, other.lengths])
        self.offsets = torch.cat([self.offsets, other.offsets])
        self.dense = bool(self.valid.all())

    def select(self, rows: Sequence[int]) -> None:
        """Keep only the given rows, in that order (in place where rows leaving are filled from the end)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.valid.device)
        for layer in self.layers:
            layer.select_rows(idx)
        self.valid = self.valid[idx]
        self.lengths = self.lengths[idx]
        self.offsets = self.offsets[idx]
        self.dense = self.dense or bool(self.valid.all())

    def subset(self, rows: Sequence[int]) -> "ContextCache":
        """A new cache holding copies of the given rows; this one is left as it is."""
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.valid.device)
        part = ContextCache(self.compact_slack)
        part.layers = [HeadroomLayer.holding(layer.keys[idx], layer.values[idx]) for layer in self.layers]
        part.valid, part.lengths, part.offsets = self.valid[idx], self.lengths[idx], self.offsets[idx]
        part.dense = self.dense or bool(part.valid.all())
        return part
