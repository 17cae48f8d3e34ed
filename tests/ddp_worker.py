"""Run by torchrun in test_training: train the tiny drafter with DDP and save its weights."""
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from dspark.training.block_objective import block_drafter_loss
from dspark.training.feature_cache import build_feature_cache
from dspark.training.trainer import train
from tests.training_fixtures import tiny_setup

if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir = sys.argv[1]
    target, drafter, seqs, cfg = tiny_setup()
    cache = None
    if len(sys.argv) > 2 and sys.argv[2] == "cache":  # both ranks build the feature cache, a shard each in turn
        dist.init_process_group("gloo")
        cache = build_feature_cache(target, seqs, [0, 2], out_dir + "/cache", dtype=torch.float32, autocast=False,
                                    rows_per_shard=5)
    train(drafter, target, seqs, block_drafter_loss, cfg, out_dir + "/state", features=cache)
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, out_dir + "/ddp.safetensors")
    dist.destroy_process_group()
