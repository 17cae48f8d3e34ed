"""Short identities of a target and a drafter, so files fitted for one pair (calibrations, step profiles)
are never silently used with another."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dspark.drafters.base import Drafter
from dspark.target import CausalLM

_VOLATILE = {"dtype", "torch_dtype", "transformers_version", "_name_or_path", "architectures"}


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def target_id(target: CausalLM) -> str:
    """'<model_type>-<hash of its config>' (the dtype left out: a calibration holds across dtypes)."""
    cfg = {k: v for k, v in target.model.config.to_dict().items() if k not in _VOLATILE}
    return f"{cfg.get('model_type', 'model')}-{_digest(cfg)}"


def drafter_id(drafter: Drafter) -> str:
    """'<name>' plus a hash of the checkpoint's config.json and weight file sizes when it has a folder."""
    name = getattr(drafter, "name", "drafter")
    path = getattr(drafter, "source_path", None)
    parts: dict = {"name": name}
    if path is not None and Path(path).is_dir():
        folder = Path(path)
        cfg = folder / "config.json"
        parts["config"] = cfg.read_text(encoding="utf-8") if cfg.exists() else ""
        parts["weights"] = sorted((p.name, p.stat().st_size) for p in folder.glob("*.safetensors"))
    return f"{name}-{_digest(parts)}"
