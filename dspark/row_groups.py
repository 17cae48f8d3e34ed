"""The engine's running rows split into padded groups by length, all fed by one packed model call.

A `CausalLM` pads every row to its widest: each query attends over (and the cache holds) as many slots as the
longest row plus the holes rollbacks left, and one long prompt makes every short request pay for its slots.
On the held-out prompts (median 40 tokens, a tail of code prompts up to 374) rows of 32 concurrent requests
held about 90 tokens while spanning 300–570 slots. `RowGroups` keeps the rows in a few `CausalLM` wrappers of
the same model (groups): a joining row goes where its reach (the slots it may come to span: prompt, output
budget, one block) adds least to Σ rows × reach over the groups, so a long prompt starts a group of its own
instead of widening everyone's; after each join, rows move between the groups where the best split by reach
saves more than a group costs (`_rebalance`). A pass over all rows is one model call
(`dspark.target.forward_packed`): attention per group over that group's cache, everything else over the packed
tokens, so a group costs one more attention call per layer, not a pass.

Rows keep the engine's order (row r is the engine's r-th running request); `_group` / `_index` map it to (group,
row in group). Outputs are gathered back into that order. Where the model does not pack, everything stays in one
group. With one group allowed (`EngineConfig.row_groups = 1`, the default) this is the target's own cache.

Measured (docs/serving.md, "Row groups"): at 32 clients the split cut the slots a row attends over from 259 to
154 on average, but the pass did not get faster, so it is opt-in.
"""
from __future__ import annotations

from typing import Sequence

import torch

from dspark.target import CausalLM, ForwardOutput, forward_packed

MAX_GROUPS = 2
_CPU = torch.device("cpu")  # the bookkeeping's tensors, whatever torch's default device
#: what an extra group costs, in row-slots of attention: one more attention call per layer (about 1 ms a pass
#: on the bundled target, 2 cores, against about 35 ns a row-slot per layer for 1 query a row, 155 ns for 8)
GROUP_SLOTS = 1024


class RowGroups:
    """Rows of one model in up to `max_groups` padded caches, addressed in the engine's row order."""

    def __init__(self, lead: CausalLM, max_groups: int = MAX_GROUPS) -> None:
        """lead: the first group's wrapper (the engine's target); others are `lead.empty_like()`."""
        if max_groups < 1:
            raise ValueError(f"max_groups must be at least 1, got {max_groups}")
        self.lead = lead
        self.max_groups = max_groups
        self.groups: list[CausalLM] = [lead]
        self.reset()

    # ----------------------------------------------------------------- layout
    def reset(self) -> None:
        """No rows; the extra groups are dropped."""
        self.lead.reset(0)
        self.groups = [self.lead]
        self._group = torch.zeros(0, dtype=torch.long, device=_CPU)  # the group of each row, engine order
        self._index = torch.zeros(0, dtype=torch.long, device=_CPU)  # its row within that group
        self._reach = torch.zeros(0, dtype=torch.long, device=_CPU)  # the slots it may come to span
        self.moves = 0  # rows moved between groups so far

    @property
    def batch_size(self) -> int:
        return int(self._group.shape[0])

    def rows_of(self, g: int) -> torch.Tensor:
        """Engine rows of group g, in the group's order."""
        rows = (self._group == g).nonzero().squeeze(1)
        return rows[torch.argsort(self._index[rows])]

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens of each row, engine order (a copy)."""
        single = self._single()
        if single is not None:
            return single.lengths.clone()
        out = torch.zeros(self.batch_size, dtype=torch.long, device=self.lead.device)
        for g, lm in enumerate(self.groups):
            if lm.batch_size:
                out[self.rows_of(g).to(out.device)] = lm.lengths
        return out

    @property
    def slots(self) -> float:
        """Slots a row's query attends over, averaged over rows (`CausalLM.attended_slots` of each group)."""
        if not self.batch_size:
            return float(self.lead.valid.shape[1])
        return sum(lm.batch_size * lm.attended_slots() for lm in self.groups if lm.batch_size) / self.batch_size

    @property
    def cached_slots(self) -> int:
        """Rows × padded width, summed over the groups (what the caches hold)."""
        return sum(lm.batch_size * int(lm.valid.shape[1]) for lm in self.groups)

    @property
    def holes(self) -> float:
        """Slots per row that compaction would drop, averaged over rows."""
        if not self.batch_size:
            return 0.0
        return sum(lm.batch_size * lm.holes for lm in self.groups) / self.batch_size

    @property
    def compactions(self) -> int:
        return sum(lm.compactions for lm in self.groups)

    def compact_price(self) -> float | None:
        """Seconds compacting every group would take (None until each group with rows has compacted once)."""
        prices = [lm.compact_price() for lm in self.groups if lm.batch_size]
        return None if any(p is None for p in prices) else sum(prices)

    def compact(self) -> None:
        for lm in self.groups:
            lm.compact()

    @property
    def max_width(self) -> int | None:
        return self.lead.max_width

    @max_width.setter
    def max_width(self, width: int | None) -> None:
        for lm in self.groups:
            lm.max_width = width

    # ----------------------------------------------------------------- rows joining and leaving
    def extend(self, other: CausalLM, reach: Sequence[int] | None = None) -> None:
        """Append `other`'s rows after the engine's rows, each into the group where it costs least (`_choose`);
        `other` is emptied. reach: the slots each joining row may come to span (default: its length now)."""
        count = other.batch_size
        if count == 0:
            return
        reach_t = other.lengths.cpu() if reach is None else torch.as_tensor(list(reach), dtype=torch.long, device=_CPU)
        if reach_t.shape[0] != count:
            raise ValueError(f"got {reach_t.shape[0]} reaches for {count} joining rows")
        chosen = self._choose(reach_t.tolist())
        self._open(max(chosen))
        index = [0] * count
        left = list(range(count))  # other's rows still there, by joining position
        for g in sorted(set(chosen)):
            mine = [i for i in left if chosen[i] == g]
            lm = self.groups[g]
            base = lm.batch_size
            if len(mine) == len(left):
                lm.extend(other)
            else:
                lm.extend(other.take([left.index(i) for i in mine]))
                left = [i for i in left if chosen[i] != g]
            for k, i in enumerate(mine):
                index[i] = base + k
        self._group = torch.cat([self._group, torch.tensor(chosen, dtype=torch.long, device=_CPU)])
        self._index = torch.cat([self._index, torch.tensor(index, dtype=torch.long, device=_CPU)])
        self._reach = torch.cat([self._reach, reach_t])
        other.reset(0)
        self._rebalance()

    def _cost(self, group: torch.Tensor) -> int:
        """Σ over non-empty groups of rows × widest reach, plus GROUP_SLOTS for each group past the first."""
        total, used = 0, 0
        for g in range(int(group.max()) + 1 if group.numel() else 0):
            mine = self._reach[group == g]
            if mine.numel():
                total += int(mine.shape[0]) * int(mine.max())
                used += 1
        return total + GROUP_SLOTS * max(0, used - 1)

    def _rebalance(self) -> None:
        """Split the rows in two by reach where that saves more than a group costs (the best threshold over
        every row's reach), moving the rows on the wrong side; only when the saving against the groups as they
        are exceeds GROUP_SLOTS, so that small shifts do not move rows back and forth."""
        if self.max_groups < 2 or self.batch_size < 2 or not self.lead.packs:
            return
        reach = self._reach
        best, best_cost = None, self.batch_size * int(reach.max())
        for cut in sorted(set(reach.tolist()))[:-1]:
            long = reach > cut
            cost = int((~long).sum()) * cut + int(long.sum()) * int(reach.max()) + GROUP_SLOTS
            if cost < best_cost:
                best, best_cost = long.long(), cost
        if best is None or self._cost(self._group) - best_cost <= GROUP_SLOTS:
            return
        # label the sides so that the fewer row-slots move
        moved = lambda labels: int((self._reach * (self._group != labels).long()).sum())  # noqa: E731
        labels = best if moved(best) <= moved(1 - best) else 1 - best
        for g in (0, 1):
            self._move((self._group != labels) & (self._group == g), 1 - g)

    def _move(self, rows: torch.Tensor, to: int) -> None:
        """Move the engine rows marked in `rows` (all of one group) into group `to`, after its rows."""
        picked = rows.nonzero().squeeze(1)
        if not picked.numel():
            return
        src = int(self._group[picked[0]])
        self._open(to)
        source, dest = self.groups[src], self.groups[to]
        base = dest.batch_size
        dest.extend(source.take(self._index[picked].tolist()))
        stay = (self._group == src) & ~rows
        kept = stay.nonzero().squeeze(1)
        # `take` keeps the rows that stay in their order: renumber them 0, 1, ...
        self._index[kept[torch.argsort(self._index[kept])]] = torch.arange(kept.shape[0], device=_CPU)
        self._group[picked] = to
        self._index[picked] = torch.arange(base, base + picked.shape[0], device=_CPU)
        self.moves += int(picked.shape[0])

    def _open(self, g: int) -> None:
        """Make sure group g exists (new groups: empty wrappers of the lead's model, its width limit)."""
        while g >= len(self.groups):
            extra = self.lead.empty_like()
            extra.max_width = self.lead.max_width
            self.groups.append(extra)

    def _choose(self, reaches: list[int]) -> list[int]:
        """A group for each joining row, in turn: the one where it adds least to Σ rows × widest reach, an empty
        or new group costing `GROUP_SLOTS` more (one more attention call per layer; only where the model packs)."""
        limit = self.max_groups if self.lead.packs else 1
        rows = [int((self._group == g).sum()) for g in range(len(self.groups))]
        widest = [int(self._reach[self._group == g].max()) if rows[g] else 0 for g in range(len(self.groups))]
        chosen = []
        for reach in reaches:
            costs = [(rows[g] + 1) * max(widest[g], reach) - rows[g] * widest[g] + (0 if rows[g] else GROUP_SLOTS)
                     for g in range(len(rows))]
            if len(rows) < limit:
                costs.append(reach + GROUP_SLOTS)
            best = min(range(len(costs)), key=lambda g: (costs[g], g))
            if best == len(rows):
                rows.append(0)
                widest.append(0)
            rows[best] += 1
            widest[best] = max(widest[best], reach)
            chosen.append(best)
        return chosen

    def select(self, keep: Sequence[int]) -> None:
        """Keep only the given engine rows, in that order."""
        keep_t = torch.as_tensor(list(keep), dtype=torch.long, device=_CPU)
        group, old = self._group[keep_t], self._index[keep_t]
        index = torch.zeros_like(old)
        for g, lm in enumerate(self.groups):
            at = (group == g).nonzero().squeeze(1)  # in the engine's new order: one group selects as `keep` says
            lm.select(old[at].tolist())
            index[at] = torch.arange(at.shape[0], device=_CPU)
        self._group, self._index, self._reach = group, index, self._reach[keep_t]

    def truncate(self, lengths: Sequence[int] | torch.Tensor) -> None:
        """Keep only the first `lengths[r]` tokens of engine row r."""
        if len(lengths) != self.batch_size:
            raise ValueError(f"got {len(lengths)} lengths for {self.batch_size} rows")
        single = self._single()
        if single is not None:  # as the target's own cache: the lengths stay where they are
            single.truncate(lengths)
            return
        keep = torch.as_tensor(lengths, dtype=torch.long, device=_CPU)
        for g, lm in enumerate(self.groups):
            if lm.batch_size:
                lm.truncate(keep[self.rows_of(g)])

    # ----------------------------------------------------------------- passes
    def _single(self) -> CausalLM | None:
        """The one group holding every row in the engine's order, if so."""
        groups = [lm for lm in self.groups if lm.batch_size]
        if len(groups) == 1 and bool((self._index == torch.arange(self.batch_size, device=_CPU)).all()):
            return groups[0]
        return None

    def forward(self, new_tokens: Sequence[Sequence[int]], features: bool = False) -> ForwardOutput:
        """Append `new_tokens[r]` to engine row r; outputs as `CausalLM.forward` gives them, engine order."""
        single = self._single()
        if single is not None or not self.batch_size:
            return (single or self.lead).forward(new_tokens, features=features)
        parts = self._parts(new_tokens)
        if self.lead.packs:
            outs = forward_packed([lm for lm, _, _ in parts], [toks for _, _, toks in parts], [False] * len(parts),
                                  features)
        else:  # one group (`_choose`), its rows in another order than the engine's
            outs = [lm.forward(toks, features=features) for lm, _, toks in parts]
        return self._gather(parts, outs, new_tokens)

    def forward_with(self, side: CausalLM, new_tokens: Sequence[Sequence[int]],
                     side_tokens: Sequence[Sequence[int]], features: bool = False
                     ) -> tuple[ForwardOutput, ForwardOutput]:
        """`forward(new_tokens)` and a prefill chunk `side.forward(side_tokens, last_logits_only=True)` in one
        model call where the model packs (`CausalLM.forward_with`)."""
        single = self._single()
        if single is not None:
            return single.forward_with(side, new_tokens, side_tokens, features=features)
        if not self.lead.packs:
            return (self.forward(new_tokens, features=features),
                    side.forward(side_tokens, features=features, last_logits_only=True))
        parts = self._parts(new_tokens)
        outs = forward_packed([lm for lm, _, _ in parts] + [side], [toks for _, _, toks in parts] + [side_tokens],
                              [False] * len(parts) + [True], features)
        return self._gather(parts, outs[:-1], new_tokens), outs[-1]

    def _parts(self, new_tokens: Sequence[Sequence[int]]) -> list[tuple[CausalLM, torch.Tensor, list]]:
        if len(new_tokens) != self.batch_size:
            raise ValueError(f"got {len(new_tokens)} rows of tokens for a batch of {self.batch_size}")
        parts = []
        for g, lm in enumerate(self.groups):
            if lm.batch_size:
                rows = self.rows_of(g)
                parts.append((lm, rows, [new_tokens[r] for r in rows.tolist()]))
        return parts

    def _gather(self, parts, outs: list[ForwardOutput], new_tokens: Sequence[Sequence[int]]) -> ForwardOutput:
        """The groups' outputs back in engine order, padded to the widest row's new tokens."""
        width = max(1, max((len(t) for t in new_tokens), default=1))
        first = outs[0].logits
        logits = first.new_zeros(self.batch_size, width, first.shape[-1])
        feats = None
        if outs[0].features is not None:
            feats = outs[0].features.new_zeros(self.batch_size, width, outs[0].features.shape[-1])
        for (_, rows, _), out in zip(parts, outs):
            rows = rows.to(logits.device)
            logits[rows, : out.logits.shape[1]] = out.logits
            if feats is not None:
                feats[rows, : out.features.shape[1]] = out.features
        return ForwardOutput(logits, feats)
