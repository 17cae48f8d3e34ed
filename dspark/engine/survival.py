"""Calibrated survival a[r, k] = P(drafts 1..k of row r all accepted) of a proposed block."""
from __future__ import annotations

from typing import Sequence

import torch

from dspark.calibration.maps import default_map
from dspark.calibration.signals import block_signals
from dspark.drafters.base import DraftBlock, Drafter
from dspark.sampling import BatchSampling


def survival_for(drafter: Drafter, block: DraftBlock, sampling: BatchSampling, temperatures: list[float],
                 signals: torch.Tensor | None = None, online=None,
                 workloads: Sequence[str | None] | None = None) -> torch.Tensor:
    """Calibrated survival a [R, γ] of a block: the online calibrator (per workload), else the drafter's
    calibration (its workload's maps where it has them; else the default map), on the block's signals (never the drafted tokens' own probabilities)."""
    calibration = getattr(drafter, "calibration", None)
    if signals is None:
        signals = block_signals(block, sampling.greedy, q=reads_q(calibration, online))
    if signals.shape[1] == 0:  # no row drafted anything (e.g. no n-gram match)
        return torch.zeros(signals.shape[0], 0)
    if online is not None:
        return online.survival(signals, block.lengths.cpu(), temperatures, workloads)
    if calibration is None:
        return default_map(block.confidences is not None, signals.shape[1]).survival(signals, block.lengths.cpu())
    return calibration.survival(signals, block.lengths.cpu(), temperatures, workloads)


def reads_q(calibration, online=None) -> bool:
    """Whether survival reads the sampled rows' drafting-distribution signals (channels 1-2). With an online
    calibrator its prior decides (one that names no prior is given every signal); else the drafter's
    calibration (the default maps read none)."""
    if online is not None:
        return bool(getattr(getattr(online, "prior", None), "reads_q", True))
    return bool(getattr(calibration, "reads_q", False))
