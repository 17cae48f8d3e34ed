"""How wide one prefill pass is: the prompts joining the batch share one padded pass per engine step.

Every prefilling row of a pass spans the pass's width, whatever it feeds: a pass of width w over R rows
computes R·w slots and feeds Σ_r min(todo_r, w) prompt tokens. Feeding every prompt to its end pads the short
ones to the longest (one 374-token prompt beside two of 30 costs 3 × 374 slots for 434 tokens), while a
narrow pass pays the pass's fixed cost (the layers' launches, norms, the call itself) for few tokens. The
width maximises prompt tokens fed per unit of cost, the cost of a pass modelled as PASS_SLOTS + R·w: rows
with the least left finish first and join the batch, and a long prompt continues in later steps.

Where the chunk rides in the running rows' own target pass instead (`fused_prefill_width`), it pays neither
a fixed cost nor padding, and feeds as much as the step's budget allows.
"""
from __future__ import annotations

from collections.abc import Sequence

#: the fixed cost of one pass, in slots (measured for the bundled target on 2 CPU cores: a pass costs about
#: 12 ms plus 0.09 ms per slot, so the fixed part is worth about 130 slots)
PASS_SLOTS = 128


def prefill_width(todo: Sequence[int], slot_budget: int | None = None, cap: int | None = None) -> int:
    """The width of the next prefill pass over rows with `todo[r]` prompt tokens left (each > 0).

    slot_budget: rows × width the pass may span (while other requests decode; None: no limit, though at
    least one token per row). cap: the widest the pass may be (a KV limit). Returns 0 when nothing fits.
    """
    rows = len(todo)
    if rows == 0 or max(todo) <= 0:
        return 0
    limit = max(todo)
    if slot_budget is not None:
        limit = min(limit, max(1, slot_budget // rows))
    if cap is not None:
        limit = min(limit, cap)
    if limit < 1:
        return 0
    best, best_score = limit, -1.0
    for width in sorted({t for t in todo if 0 < t < limit} | {limit}):
        fed = sum(min(t, width) for t in todo)
        score = fed / (PASS_SLOTS + rows * width)
        if score > best_score:
            best, best_score = width, score
    return best


def fused_prefill_width(todo: Sequence[int], token_budget: int | None = None, cap: int | None = None) -> int:
    """The width of a prefill chunk fed in the running rows' target pass (`CausalLM.forward_with`).

    Packed beside the round's tokens the chunk pays no pass of its own and no padding, only its tokens, so it
    feeds as much as it may: the widest chunk whose prompt tokens Σ_r min(todo[r], w) stay within
    `token_budget` (None: every prompt to its end; at least one token per row), at most `cap`.
    Returns 0 when nothing fits.
    """
    if not todo or max(todo) <= 0:
        return 0
    limit = max(todo) if cap is None else min(max(todo), cap)
    if limit < 1:
        return 0
    if token_budget is None or sum(min(t, limit) for t in todo) <= token_budget:
        return limit
    low, high = 1, limit  # sum(min(t, w)) grows with w: the widest w within the budget, at least 1
    while low < high:
        mid = (low + high + 1) // 2
        if sum(min(t, mid) for t in todo) <= token_budget:
            low = mid
        else:
            high = mid - 1
    return low
