"""Grouped-query attention with the query heads folded into the query length, where that is faster.

With grouped-query attention (fewer key/value heads than query heads) PyTorch's `scaled_dot_product_attention`
either repeats every key and value per query head (what Hugging Face does whenever there is a mask and more
than one query) or takes `enable_gqa=True`; on a CPU in bfloat16 both are slow at serving shapes. On the
bundled target (5 query heads over 1 key/value head, 32 rows of 400 slots, 2 cores) one layer's attention took
6.1 ms for one query per row with either path and 4.9 ms for eight, against 0.5 ms and 2.4 ms folded
(benchmarks/attention_fold.py). Folding treats the G query heads that share a key/value head as G times as
many queries of that head: q [B, H, n, d] becomes [B, KV, G·n, d] and the mask is repeated per head, so every
key and value is read once per group and the kernel gets a longer query block. The arithmetic is the same
dot products and softmax as the unfolded call (outputs agree to the kernel's rounding).

Causality must be in the mask (there is no `is_causal`): a Hugging Face layer that relies on `is_causal` keeps
the plain path (`dspark.packed`). It is used on CPU only: on CUDA the kernels and their
dispatch rules differ and have not been measured here.

**Row segments.** A padded batch cache spans the longest row, and every row's queries read every slot of it,
masked or not: at 64 rows where one row holds 430 tokens and the others about 80, over three quarters of the
attention's work is on slots no query of the row may see. Where the rows' first attended slots differ, the
folded call is split into runs of consecutive rows, each over the slots from its rows' first attended one to
the end (views of the cache, no copy): the slots left out are masked for every query of those rows, so each
output is the same weighted sum (to the kernel's rounding). The runs minimise the pairs read plus a kernel
call's cost each (`SEGMENT_CALL_SLOTS`). It pays where the rows' contexts end at the cache's right end
(`CausalLM` aligns joining rows and compactions to the right) and rows of like length sit together (the
engine orders its rows by where they start, `Engine` with `EngineConfig.sort_rows`).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

_enabled = True
_segmenting = True
#: what one more kernel call costs, in row × slot pairs of attention: on the bundled target, 1 thread, 11 µs a
#: call against 33.5 ns a pair for one query a row, 335 pairs (benchmarks/attention_segments.py); set at about
#: twice that, since a call in a pass also slices the mask and writes its output
SEGMENT_CALL_SLOTS = 768


@contextmanager
def unfolded() -> Iterator[None]:
    """Within it, `gqa_attention` never folds (the unfolded path, for comparisons and benchmarks)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def set_segmenting(enabled: bool) -> None:
    """Switch row segments on or off for the whole process (`dspark serve --no-row-segments`)."""
    global _segmenting
    _segmenting = bool(enabled)


@contextmanager
def unsegmented() -> Iterator[None]:
    """Within it, `gqa_attention` runs one call over every row (no row segments; for comparisons)."""
    global _segmenting
    before, _segmenting = _segmenting, False
    try:
        yield
    finally:
        _segmenting = before


def row_segments(first: list[int], slots: int, call_slots: int | None = None) -> list[tuple[int, int, int]]:
    """Runs (start, stop, first slot) of consecutive rows, row r attending from slot first[r] on, over a cache of
    `slots`: the cover of the rows in their order that minimises the pairs attended, Σ rows × (slots − the run's
    first slot), plus `call_slots` (default `SEGMENT_CALL_SLOTS`) per run beyond the first (dynamic programming
    over the run ends). One run (0, rows, min(first)) where no split pays."""
    call_slots = SEGMENT_CALL_SLOTS if call_slots is None else call_slots
    rows = len(first)
    if rows == 0:
        return [(0, 0, 0)]
    f = np.asarray(first, dtype=np.int64)
    if int((f - f.min()).sum()) <= call_slots:  # no split can save a call's cost
        return [(0, rows, int(f.min()))]
    # low[a, b]: the least first slot among rows a..b (b ≥ a)
    low = np.where(np.arange(rows)[None, :] >= np.arange(rows)[:, None], f[None, :], np.iinfo(np.int64).max)
    low = np.minimum.accumulate(low, axis=1)
    best = np.zeros(rows + 1, dtype=np.float64)
    cut = np.zeros(rows + 1, dtype=np.int64)
    for b in range(1, rows + 1):
        starts = np.arange(b)
        cost = best[:b] + (b - starts) * (slots - low[starts, b - 1]) + call_slots
        a = int(np.argmin(cost))
        best[b], cut[b] = cost[a], a
    runs, b = [], rows
    while b > 0:
        a = int(cut[b])
        runs.append((a, b, int(low[a, b - 1])))
        b = a
    return runs[::-1]


def segment_cost(first: list[int], slots: int, call_slots: int | None = None) -> int:
    """What attention over these rows costs once split in `row_segments`, in row × slot pairs: the pairs read
    plus `call_slots` (default `SEGMENT_CALL_SLOTS`) for each call beyond the first."""
    call_slots = SEGMENT_CALL_SLOTS if call_slots is None else call_slots
    runs = row_segments(first, slots, call_slots)
    return sum((b - a) * (slots - lo) for a, b, lo in runs) + call_slots * (len(runs) - 1)


def _folding(heads: int, kv_heads: int, device: torch.device) -> bool:
    """Whether `gqa_attention` folds calls with these heads on `device`: grouped heads, on CPU."""
    return _enabled and kv_heads < heads and heads % kv_heads == 0 and device.type == "cpu"


def segments_for(heads: int, kv_heads: int, device: torch.device) -> bool:
    """Whether `gqa_attention` splits calls of a model with these heads on `device` into row segments."""
    return _segmenting and _folding(heads, kv_heads, device)


def folds(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether `gqa_attention` folds this call: grouped heads, on CPU."""
    return _folding(query.shape[1], key.shape[1], query.device)


def gqa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                  scale: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """`scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)` with key/value heads shared
    by groups of query heads (query [B, H, n, d], key / value [B, KV, S, d], H a multiple of KV; query head h reads
    key/value head h // (H / KV), as `repeat_kv` lays them out). mask: bool (True: attend) or additive float,
    broadcastable to [B, H, n, S]; None: every key for every query (no causal mask). Returns [B, H, n, d]."""
    batch, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    if not folds(query, key):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale,
                                              enable_gqa=kv_heads != heads)
    groups = heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * n, dim)
    runs = None
    if mask is not None:
        mask, runs = _folded_mask(mask, heads, kv_heads, n, query.dtype)
    if runs is None or len(runs) == 1 and runs[0][2] == 0 or mask.shape[0] != batch:
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=dropout, scale=scale)
        return out.view(batch, heads, n, dim)
    out = q.new_empty(batch, kv_heads, groups * n, value.shape[-1])
    for a, b, lo in runs:
        out[a:b] = F.scaled_dot_product_attention(q[a:b], key[a:b, :, lo:], value[a:b, :, lo:],
                                                  attn_mask=mask[a:b, :, :, lo:], dropout_p=dropout, scale=scale)
    return out.view(batch, heads, n, value.shape[-1])


# The last masks folded, newest first: the layers of one pass share their mask, so it is folded (and made additive),
# and its row segments chosen, once a pass. A packed pass alternates its groups' masks at every layer, so one entry
# would miss at every call of such a pass (a fused prefill chunk beside the running rows: 24 folds and segment
# choices a pass of 12 layers instead of 2).
_FOLDED_KEPT = 4
_kept = _FOLDED_KEPT
_folded: list[tuple[torch.Tensor, tuple, torch.Tensor, list | None]] = []


@contextmanager
def one_fold_kept() -> Iterator[None]:
    """Within it, only the last mask folded is kept, known by the tensor object (so the drafters' per-layer views
    miss): how masks were folded before the cache kept several (for comparisons)."""
    global _kept
    before, _kept = _kept, 1
    _folded.clear()
    try:
        yield
    finally:
        _kept = before
        _folded.clear()


def _folded_mask(mask: torch.Tensor, heads: int, kv_heads: int, n: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, list[tuple[int, int, int]] | None]:
    """mask [B, 1 or H, n or 1, S] → additive [B, 1 or KV, G·n, S] in `dtype` (0: attend, -inf: not), and the
    row segments its rows' first attended slots call for (`row_segments`; None with segments off or where the
    call reads fewer pairs than one more call costs)."""
    # a mask is known by its storage, shape and strides: the per-layer `mask.unsqueeze(1)` views of one pass hit,
    # and a kept mask holds its storage, so no other mask can come to start there
    key = (mask.data_ptr(), tuple(mask.shape), mask.stride(), mask.dtype, heads, kv_heads, n, dtype, _segmenting)
    if _kept == 1:  # `one_fold_kept`: the mask object itself, as before
        key = (id(mask),) + key
    for kept in _folded:
        if kept[1] == key:
            return kept[2], kept[3]
    if mask.dim() != 4:
        raise ValueError(f"attention mask must have 4 dimensions [B, 1 or H, n, S], got {tuple(mask.shape)}")
    groups = heads // kv_heads
    b, h, _, slots = mask.shape
    runs = None
    if _segmenting and slots * b > SEGMENT_CALL_SLOTS:
        seen = mask if mask.dtype == torch.bool else mask > float("-inf")
        seen = seen.reshape(b, -1, slots).any(dim=1)
        first = torch.where(seen.any(dim=1), seen.to(torch.int8).argmax(dim=1), 0)
        runs = row_segments(first.tolist(), slots)
    if h == 1:  # one mask for every head: repeat it for each head of a group
        folded = mask.expand(b, groups, n, slots).reshape(b, 1, groups * n, slots)
    else:
        folded = mask.expand(b, heads, n, slots).reshape(b, kv_heads, groups * n, slots)
    if folded.dtype == torch.bool:
        folded = torch.zeros(folded.shape, dtype=dtype, device=folded.device).masked_fill_(~folded, float("-inf"))
    else:
        folded = folded.to(dtype)
    _folded.insert(0, (mask, key, folded, runs))
    del _folded[_kept:]
    return folded, runs
