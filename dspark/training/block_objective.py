"""Training objective of DFlash / DSpark drafters: one frozen-target pass, many anchored blocks, one loss."""
from __future__ import annotations

import torch

from dspark.drafters.block import DSparkModel
from dspark.training.blocks import AnchoredBlocks, build_blocks, sample_anchors
from dspark.training.feature_cache import target_outputs
from dspark.training.losses import LossWeights, drafter_loss


def target_pass(target_model, input_ids: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Frozen target over one sequence [S]: (features [S, m*d] of layers id+1, logits [S, V])."""
    feats, _, logits = target_outputs(target_model, input_ids, layer_ids)
    return feats, logits


def block_logits(model: DSparkModel, target_model, feats: torch.Tensor, blocks: AnchoredBlocks
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced draft logits [n, γ, V] (backbone plus sequential bias) and hidden states [n, γ, d]
    of the anchored `blocks` of one sequence whose target features are `feats` [S, m*d]."""
    seq_len = feats.shape[0]
    ctx_kv = model.context_kv(feats.unsqueeze(0), torch.arange(seq_len, device=feats.device).unsqueeze(0))
    with torch.no_grad():
        block_embeds = target_model.get_input_embeddings()(blocks.input_ids).unsqueeze(0)
    h = model(block_embeds, blocks.positions.unsqueeze(0), ctx_kv, blocks.mask.unsqueeze(0))
    n, g = blocks.labels.shape
    h = h.view(n, g, -1)
    logits = target_model.get_output_embeddings()(h).float()
    if model.markov_head is not None:
        logits = logits + model.markov_head.block_bias(h, blocks.prev_ids).float()
    return logits, h


def block_drafter_loss(
    model: DSparkModel,
    target_model,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    generator: torch.Generator,
    num_anchors: int,
    weights: LossWeights,
    target_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """Loss of a block drafter on one sequence (input_ids, loss_mask [S]); None when it has no anchor.

    `target_out` = (features, logits) of the sequence from a feature cache; computed here when None.
    """
    cfg = model.cfg
    if cfg.slot_convention != "next":
        raise ValueError("training supports the 'next' slot convention (DeepSpec/DSpark) only")
    anchors = sample_anchors(loss_mask, num_anchors, generator)
    if anchors.numel() == 0:
        return None
    feats, t_logits = target_out if target_out is not None else target_pass(target_model, input_ids, cfg.target_layer_ids)
    blocks = build_blocks(input_ids, loss_mask, anchors, cfg.block_size, cfg.mask_token_id)
    logits, h = block_logits(model, target_model, feats, blocks)
    conf = None
    if model.confidence_head is not None:
        conf = model.confidence_head(h, model.prev_embed(blocks.prev_ids))
    # Softmax once per sequence position; the blocks' slots gather from it (they overlap).
    target_probs = torch.softmax(t_logits.float(), -1)[blocks.label_pos]
    return drafter_loss(logits, None, blocks.labels, blocks.valid, weights, conf, target_probs=target_probs)
