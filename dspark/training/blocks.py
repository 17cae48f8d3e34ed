"""Anchored training blocks: many draft blocks per sequence in one pass, each with its own mask.

For a sequence of S tokens with target features, anchors a_1..a_n are drawn among answer positions
whose next token is also an answer token. Block b is [x_{a_b}, mask × (γ−1)] at positions a_b..a_b+γ−1
and its queries may see the context strictly before a_b and their own block (bidirectionally), never
another block. With the "next" slot convention slot k is labelled with x_{a_b+k+1} and compared with
the target's distribution at position a_b+k; supervision stops at the first label outside the answer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AnchoredBlocks:
    """Block inputs for one sequence: n anchors × γ slots, flattened to Q = n·γ queries.

    input_ids [Q]; positions [Q]; mask bool [Q, S + Q]; labels [n, γ]; label_pos [n, γ] (target position
    whose distribution the slot imitates); valid bool [n, γ]; prev_ids [n, γ] (teacher-forced x_{k−1}).
    """

    anchors: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    labels: torch.Tensor
    label_pos: torch.Tensor
    valid: torch.Tensor
    prev_ids: torch.Tensor


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Sorted random anchor positions i with loss_mask[i+1] (at most num_anchors).

    The anchor itself may lie outside the answer: the last token of the chat header (`<|im_start|>assistant\n`)
    is the anchor of every request's first round at inference, so its block must be learned too."""
    m = loss_mask.bool()
    candidates = m[1:].nonzero().flatten()
    if len(candidates) > num_anchors:
        pick = torch.randperm(len(candidates), generator=generator)[:num_anchors]
        candidates = candidates[pick]
    return candidates.sort().values


def build_blocks(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> AnchoredBlocks:
    """Inputs, masks and labels of the blocks at `anchors` of one sequence (input_ids [S])."""
    seq_len = input_ids.shape[0]
    n, g = anchors.shape[0], block_size
    device = input_ids.device
    offs = torch.arange(g, device=device)
    block_ids = torch.full((n, g), mask_token_id, dtype=torch.long, device=device)
    block_ids[:, 0] = input_ids[anchors]
    positions = anchors.view(-1, 1) + offs.view(1, -1)
    label_idx = positions + 1
    in_seq = label_idx < seq_len
    clamped = label_idx.clamp(max=seq_len - 1)
    labels = input_ids[clamped]
    valid = in_seq & loss_mask.bool()[clamped]
    valid = torch.cumprod(valid.long(), dim=1).bool()
    prev_ids = input_ids[positions.clamp(max=seq_len - 1)]
    q = n * g
    block_of = torch.arange(n, device=device).repeat_interleave(g)
    ctx_ok = torch.arange(seq_len, device=device).view(1, -1) < anchors[block_of].view(-1, 1)
    blk_ok = block_of.view(-1, 1) == block_of.view(1, -1)
    mask = torch.cat([ctx_ok, blk_ok], dim=1)
    return AnchoredBlocks(
        anchors=anchors, input_ids=block_ids.reshape(q), positions=positions.reshape(q), mask=mask,
        labels=labels, label_pos=positions.clamp(max=seq_len - 1), valid=valid, prev_ids=prev_ids,
    )
