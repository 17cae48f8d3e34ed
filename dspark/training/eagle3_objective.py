"""EAGLE-3 training with a training-time-test (TTT) horizon: J chained steps over one target pass.

Step 0 reads the pairs (fc(f_t), x_{t+1}) for every t and predicts x_{t+2}. Step j reads the previous
step's output hidden state at the same index with the token x_{t+1+j} at position t+j and predicts
x_{t+2+j}: exactly what drafting step j sees, with teacher-forced tokens. Query t of step j attends to
step-0 keys at indices <= t and to the keys of steps 1..j at index t only. Each step's loss is the soft
cross-entropy against the target's distribution, weighted by decay^j (DeepSpec: 0.8).
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from dspark.drafters.eagle3 import Eagle3Model
from dspark.training.block_objective import target_pass


def ttt_logits(model: Eagle3Model, target_model, input_ids: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Draft logits [S−2, V] of each TTT step j (index t predicts x_{t+2+j})."""
    seq_len = input_ids.shape[0]
    n = seq_len - 2
    embed, lm_head = target_model.get_input_embeddings(), target_model.get_output_embeddings()
    layer = model.layers[0]
    idx = torch.arange(n, device=input_ids.device)
    hidden = model.project(feats[:n]).unsqueeze(0)
    causal = idx.view(-1, 1) >= idx.view(1, -1)
    diag = idx.view(-1, 1) == idx.view(1, -1)
    keys, values, out_logits = [], [], []
    for j in range(steps):
        with torch.no_grad():
            tok_emb = embed(input_ids[(idx + 1 + j).clamp(max=seq_len - 1)]).unsqueeze(0)
        x = layer.inputs(tok_emb.to(hidden.dtype), hidden)
        q, k, v = layer.self_attn.qkv(x, (idx + j).unsqueeze(0))
        keys.append(k)
        values.append(v)
        mask = torch.cat([causal] + [diag] * j, dim=1).unsqueeze(0)
        hidden = layer.finish(hidden, layer.self_attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), mask))
        out_logits.append(lm_head(model.norm(hidden[0])).float())
    return out_logits


def ttt_targets(loss_mask: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For TTT step `step` over a sequence with loss_mask [S]: the index [S−2] of the target position
    whose distribution each row imitates (its token x_{t+1+j}), and whether the row is supervised (its label
    x_{t+2+j} is an answer token; its input token may be the chat header's last one, the anchor of every
    request's first round at inference)."""
    seq_len = loss_mask.shape[0]
    idx = torch.arange(seq_len - 2, device=loss_mask.device)
    label_idx = idx + 2 + step
    tok_idx = (idx + 1 + step).clamp(max=seq_len - 1)
    lm = loss_mask.bool()
    return tok_idx, (label_idx < seq_len) & lm[label_idx.clamp(max=seq_len - 1)]


def eagle3_loss(
    model: Eagle3Model,
    target_model,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    generator: torch.Generator | None = None,
    target_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """TTT loss of an EAGLE-3 drafter on one sequence (input_ids, loss_mask [S]); None if nothing to learn.

    `target_out` = (features, logits) of the sequence from a feature cache; computed here when None.

    Also returns accept_rate [J]: mean analytic acceptance 1 − ½‖p_draft − p_target‖₁ per step (NaN
    for a step without supervised positions).
    """
    cfg = model.cfg
    seq_len = input_ids.shape[0]
    if seq_len < 3:
        return None
    feats, t_logits = target_out if target_out is not None else target_pass(target_model, input_ids, cfg.target_layer_ids)
    total, norm, accept = 0.0, 0.0, []
    for j, logits in enumerate(ttt_logits(model, target_model, input_ids, feats, cfg.ttt_length)):
        tok_idx, valid = ttt_targets(loss_mask, j)
        valid = valid.float()
        with torch.no_grad():
            p_t = torch.softmax(t_logits[tok_idx].float(), -1)
        if valid.sum() == 0:
            accept.append(torch.tensor(float("nan")))
            continue
        soft_ce = -(p_t * F.log_softmax(logits, -1)).sum(-1)
        weight = cfg.step_loss_decay**j
        total = total + weight * (soft_ce * valid).sum() / valid.sum()
        norm += weight
        with torch.no_grad():
            c_star = 1 - 0.5 * (torch.softmax(logits, -1) - p_t).abs().sum(-1)
            accept.append((c_star * valid).sum() / valid.sum())
    if norm == 0:
        return None
    loss = total / norm
    return loss, {"soft_ce": loss.detach(), "accept_rate": torch.stack(accept)}
