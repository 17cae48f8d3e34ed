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
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

_enabled = True


@contextmanager
def unfolded() -> Iterator[None]:
    """Within it, `gqa_attention` never folds (the unfolded path, for comparisons and benchmarks)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def folds(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether `gqa_attention` folds this call: grouped heads, on CPU."""
    heads, kv_heads = query.shape[1], key.shape[1]
    return _enabled and kv_heads < heads and heads % kv_heads == 0 and query.device.type == "cpu"


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
    if mask is not None:
        mask = _folded_mask(mask, heads, kv_heads, n, query.dtype)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.view(batch, heads, n, dim)


# The last mask folded: the layers of one pass share their mask, so it is folded (and made additive) once a pass.
_last: tuple[torch.Tensor, tuple, torch.Tensor] | None = None


def _folded_mask(mask: torch.Tensor, heads: int, kv_heads: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """mask [B, 1 or H, n or 1, S] → additive [B, 1 or KV, G·n, S] in `dtype` (0: attend, -inf: not)."""
    global _last
    key = (heads, kv_heads, n, dtype)
    if _last is not None and _last[0] is mask and _last[1] == key:
        return _last[2]
    if mask.dim() != 4:
        raise ValueError(f"attention mask must have 4 dimensions [B, 1 or H, n, S], got {tuple(mask.shape)}")
    groups = heads // kv_heads
    b, h, _, slots = mask.shape
    if h == 1:  # one mask for every head: repeat it for each head of a group
        folded = mask.expand(b, groups, n, slots).reshape(b, 1, groups * n, slots)
    else:
        folded = mask.expand(b, heads, n, slots).reshape(b, kv_heads, groups * n, slots)
    if folded.dtype == torch.bool:
        folded = torch.zeros(folded.shape, dtype=dtype, device=folded.device).masked_fill_(~folded, float("-inf"))
    else:
        folded = folded.to(dtype)
    _last = (mask, key, folded)
    return folded
