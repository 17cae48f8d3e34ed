"""Copy a trained drafter into the zoo: weights, config and card, with its training log thinned.

    python scripts/install_drafter.py data/long2/dspark zoo/dspark [--every 10]

The card gets a note that the drafter was trained elsewhere and copied; the log keeps every N-th step
and the last one, so the zoo stays small.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def install(src: Path, dst: Path, every: int) -> None:
    """Copy config.json, model.safetensors and README.md from src to dst and thin train_log.jsonl."""
    for name in ("config.json", "model.safetensors", "README.md", "train_log.jsonl"):
        if not (src / name).exists():
            raise FileNotFoundError(f"{src / name} is missing: is the training finished?")
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(src / name, dst / name)
    lines = (src / "train_log.jsonl").read_text().splitlines()
    kept = [line for line in lines if json.loads(line)["step"] % every == 0]
    if lines and (not kept or kept[-1] != lines[-1]):
        kept.append(lines[-1])
    (dst / "train_log.jsonl").write_text("\n".join(kept) + "\n")
    card = (src / "README.md").read_text().rstrip("\n")
    card += (f"\n- trained into `{src}` and copied here; `scripts/build_drafters.sh` writes to `zoo/` directly "
             f"and runs the four trainings two at a time.\n- train_log.jsonl keeps every {every}th step of the "
             f"training log (and the last) to keep the zoo small.\n")
    (dst / "README.md").write_text(card)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    install(args.src, args.dst, args.every)


if __name__ == "__main__":
    main()
