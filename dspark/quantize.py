"""Weight-only int8 storage of drafter checkpoints (symmetric, one scale per row).

A drafter only proposes tokens, so storing its matrices in int8 cannot change what speculative decoding
outputs (verification keeps it lossless); it can only move acceptance, which the bench measures. A
stored matrix W [rows, cols] becomes `name` (int8, round(W / s)) and `name_scale` (float32 [rows],
s = max|W_row| / 127). Vectors (norm scales, biases) and small tensors stay in their float dtype.
Loading dequantizes to W ≈ q · s in float32, then the model casts to its dtype.
"""
from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale"
METHOD = "dspark-int8-rowwise"


def quantize_state_dict(weights: dict[str, torch.Tensor], other_dtype: torch.dtype | None = None,
                        min_numel: int = 4096) -> dict[str, torch.Tensor]:
    """int8 rows plus float32 scales for every floating 2-D tensor of at least `min_numel` elements;
    the other floating tensors are cast to `other_dtype` (None keeps theirs)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if not (w.is_floating_point() and w.dim() == 2 and w.numel() >= min_numel):
            out[name] = w.to(other_dtype) if other_dtype is not None and w.is_floating_point() else w
            continue
        if name + SCALE_SUFFIX in weights:
            raise ValueError(f"cannot quantize {name!r}: the checkpoint already has a tensor {name + SCALE_SUFFIX!r}")
        w32 = w.detach().float()
        scale = (w32.abs().amax(1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        out[name] = torch.round(w32 / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8).contiguous()
        out[name + SCALE_SUFFIX] = scale.contiguous()
    return out


def is_quantized(weights: dict[str, torch.Tensor]) -> bool:
    """True when some tensor is int8 with a matching scale."""
    return any(w.dtype == torch.int8 and name + SCALE_SUFFIX in weights for name, w in weights.items())


def dequantize_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float32 matrices from int8 rows and their scales; every other tensor is returned unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None
        if base in weights and weights[base].dtype == torch.int8:
            continue  # a scale, consumed with its matrix
        if w.dtype == torch.int8:
            scale = weights.get(name + SCALE_SUFFIX)
            if scale is None:
                raise ValueError(f"int8 tensor {name!r} has no {name + SCALE_SUFFIX!r} in the checkpoint")
            if scale.shape != (w.shape[0],):
                raise ValueError(f"{name + SCALE_SUFFIX!r} has shape {tuple(scale.shape)}, expected ({w.shape[0]},)")
            w = w.float() * scale.float().unsqueeze(1)
        out[name] = w
    return out


def quantization_config() -> dict:
    """The `quantization_config` entry written to config.json of an int8-stored drafter."""
    return {"quant_method": METHOD, "bits": 8, "scheme": "symmetric, one float32 scale per row (name_scale)",
            "dequantize": "W = int8 * scale[:, None]"}
