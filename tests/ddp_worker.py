"""Run by torchrun in test_training: train the tiny drafter with DDP and save its weights."""
import sys

import torch
from safetensors.torch import save_file

from dspark.training.block_objective import block_drafter_loss
from dspark.training.trainer import train
from tests.training_fixtures import tiny_setup

if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir = sys.argv[1]
    target, drafter, seqs, cfg = tiny_setup()
    train(drafter, target, seqs, block_drafter_loss, cfg, out_dir + "/state")
    import torch.distributed as dist

    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, out_dir + "/ddp.safetensors")
    dist.destroy_process_group()
