"""Where the bundled models live: `zoo/` beside the package, or $DSPARK_ZOO."""
from __future__ import annotations

import os
from pathlib import Path


def zoo_dir() -> Path:
    """Return the directory holding the bundled tokenizer, target, drafters and evaluation prompts."""
    env = os.environ.get("DSPARK_ZOO")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "zoo"


def default_target_path() -> Path:
    """Path of the bundled target model."""
    return zoo_dir() / "target"


def bundled_drafter_path(name: str) -> Path:
    """Path of a bundled drafter checkpoint by drafter name (e.g. 'draft-model')."""
    return zoo_dir() / name


def eval_prompts_path(domain: str) -> Path:
    """Path of the bundled evaluation prompts (JSONL) of one domain."""
    return zoo_dir() / "eval_prompts" / f"{domain}.jsonl"


DOMAINS = ("code", "prose", "math")
