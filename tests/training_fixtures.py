"""Tiny target, drafter and data shared by the training tests and the torchrun worker."""
import torch

from dspark.drafters.block import DSparkModel
from dspark.drafters.dflash_model import DFlashConfig
from dspark.training.losses import DSPARK_WEIGHTS
from dspark.training.trainer import TrainConfig
from tests.conftest import tiny_qwen3


def tiny_block_config(**kw) -> DFlashConfig:
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                num_hidden_layers=1, vocab_size=96, target_layer_ids=[0, 2], mask_token_id=95, block_size=4,
                markov_rank=8, enable_confidence_head=True)
    base.update(kw)
    return DFlashConfig(**base)


def tiny_setup(seed: int = 1):
    """(target model, fresh drafter, sequences, train config) — deterministic."""
    target = tiny_qwen3(layers=4)
    torch.manual_seed(seed)
    drafter = DSparkModel(tiny_block_config())
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(12):
        n = 20 + i
        ids = torch.randint(0, 90, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.long)
        mask[8:] = 1
        seqs.append((ids, mask))
    cfg = TrainConfig(steps=4, batch=4, lr=1e-2, ckpt_every=100, bf16=False,
                      objective_kwargs={"num_anchors": 6, "weights": DSPARK_WEIGHTS})
    return target, drafter, seqs, cfg
