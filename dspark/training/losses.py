"""Drafter losses: DSpark = α_ce·CE + α_tv·L1(p_draft, p_target) + α_conf·BCE(c_k, c*_k), position-weighted.

Position weights w_k = exp(−(k−1)/λ) for slot k = 1..γ (λ = `decay`; None or <= 0 gives uniform weights),
times the validity mask. Every term is normalised by the sum of the weights. The confidence target is
the analytic acceptance probability of the slot, c*_k = 1 − ½‖p_draft − p_target‖₁ (temperature 1, detached).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass
class LossWeights:
    """Coefficients of the loss terms and the position-decay length λ."""

    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0
    decay: float | None = 4.0


DSPARK_WEIGHTS = LossWeights(0.1, 0.9, 1.0, 4.0)
DFLASH_WEIGHTS = LossWeights(1.0, 0.0, 0.0, 4.0)


def position_weights(valid: torch.Tensor, decay: float | None) -> torch.Tensor:
    """w [..., γ] = exp(−k/λ) for 0-based slot k, zero where not valid."""
    g = valid.shape[-1]
    k = torch.arange(g, device=valid.device, dtype=torch.float32)
    w = torch.exp(-k / decay) if decay and decay > 0 else torch.ones(g, device=valid.device)
    return w * valid.float()


def drafter_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    weights: LossWeights,
    conf_logits: torch.Tensor | None = None,
    target_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total loss and its detached terms; draft/target logits [..., γ, V], labels/valid/conf [..., γ].

    `target_probs` (softmax of the target logits, same shape) may be passed instead of `target_logits`
    when the caller has them already.

    Also returns `accept_rate` [γ]: the mean analytic acceptance c* per slot (predicted per-position
    acceptance), and the confidence head's mean prediction per slot when it exists.
    """
    w = position_weights(valid, weights.decay)
    denom = w.sum().clamp_min(1e-6)
    log_q = torch.log_softmax(draft_logits.float(), -1)
    ce = -log_q.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    p_d = log_q.exp()
    p_t = target_probs if target_probs is not None else torch.softmax(target_logits.float(), -1)
    l1 = (p_d - p_t).abs().sum(-1)
    terms = {"ce": (w * ce).sum() / denom, "tv": (w * l1).sum() / denom}
    total = weights.ce * terms["ce"] + weights.tv * terms["tv"]
    c_star = (1 - 0.5 * l1.detach()).clamp(0, 1)
    if conf_logits is not None and weights.conf > 0:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")
        terms["conf"] = (w * bce).sum() / denom
        total = total + weights.conf * terms["conf"]
    vf = valid.float().flatten(0, -2)
    count = vf.sum(0).clamp_min(1)
    stats = {k: v.detach() for k, v in terms.items()}
    stats["accept_rate"] = (c_star.flatten(0, -2) * vf).sum(0) / count
    if conf_logits is not None:
        stats["conf_pred"] = (torch.sigmoid(conf_logits.detach().float()).flatten(0, -2) * vf).sum(0) / count
    return total, stats
