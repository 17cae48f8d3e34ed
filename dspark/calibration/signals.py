"""Non-anticipating per-position signals of a draft block, the inputs of every survival map.

For draft k the scheduler may read the context, drafts 1..k−1 and the distribution q_k that x_k is drawn
from, never x_k itself (shared/DESIGN.md, "Non-anticipation"). The signals below obey that:

- channel 0, ``CONF_LOGIT``: the logit of the drafter's confidence c_k (DSpark's head reads h_k and
  W1[x_{k−1}]); NaN for drafters without a confidence head.
- channel 1, ``MAX_Q``: max_x q_k(x) of a sampled row's drafting distribution. A greedy row's q is one-hot, so
  there it is the peak of the drafting logits' softmax at temperature 1 (`DraftBlock.peaks`), NaN when the
  drafter gives none; NaN for drafters without probabilities (n-gram).
- channel 2, ``ENTROPY``: the entropy of a sampled row's q_k in nats; NaN for greedy rows and where channel 1 is.

The drafted token's own probability q_k(x_k) is deliberately absent: a map of it makes admission depend
on x_k and biases sampled output.
"""
from __future__ import annotations

import torch

from dspark.drafters.base import DraftBlock

CONF_LOGIT, MAX_Q, ENTROPY = 0, 1, 2
NUM_SIGNALS = 3


def block_signals(block: DraftBlock, greedy: torch.Tensor | None = None, q: bool = True) -> torch.Tensor:
    """Return float32 signals [R, γ, 3] of a block (NaN where a signal does not exist).

    greedy: bool [R] rows that decode greedily (their q is one-hot: channel 1 is their peak, channel 2 NaN).
    q=False leaves the sampled rows' channels 1-2 NaN: their max and entropy read the whole vocabulary at
    every position, a cost worth paying only where a map reads them (`reads_q`) or the signals are recorded.
    """
    num_rows, gamma = block.tokens.shape
    out = torch.full((num_rows, gamma, NUM_SIGNALS), float("nan"), dtype=torch.float32)
    if gamma == 0:
        return out
    if block.confidences is not None:
        c = block.confidences[:, :gamma].detach().float().cpu().clamp(1e-6, 1 - 1e-6)
        out[:, : c.shape[1], CONF_LOGIT] = torch.log(c) - torch.log1p(-c)
    if q and block.probs is not None:
        probs = block.probs[:, :gamma].detach().float()
        out[:, : probs.shape[1], MAX_Q] = probs.amax(-1).cpu()
        ent = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
        out[:, : probs.shape[1], ENTROPY] = ent.cpu()
        if greedy is not None and bool(greedy.any()):
            out[greedy.cpu(), :, MAX_Q:] = float("nan")
    if block.peaks is not None:
        peaks = block.peaks[:, :gamma].detach().float().cpu()
        rows = torch.isfinite(peaks).any(1) if greedy is None else greedy.cpu()
        out[rows, : peaks.shape[1], MAX_Q] = peaks[rows]
    return out
