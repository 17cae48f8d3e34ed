"""Copy a trained drafter into the zoo: weights, config and card, with its training log thinned.

    python scripts/install_drafter.py data/long2/dspark zoo/dspark [--every 10] [--int8]

The card gets a note that the drafter was trained elsewhere and copied; the log keeps every N-th step
and the last one, so the zoo stays small. `--int8` stores the matrices as int8 rows with float32
scales (dspark.quantize), quantized from the float32 weights of the run's last train state when it is
there (else from the saved weights).
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.quantize import quantization_config, quantize_state_dict


def int8_weights(src: Path) -> dict[str, torch.Tensor]:
    """The drafter's weights quantized to int8 rows, from the float32 train state of its last step when
    that is there (else from the saved weights)."""
    saved = load_file(str(src / "model.safetensors"))
    vector_dtype = next(iter(saved.values())).dtype
    state = src / "_train_state" / "train_state.safetensors"
    meta = src / "_train_state" / "train_state.json"
    last = json.loads((src / "train_log.jsonl").read_text().splitlines()[-1])["step"]
    if state.exists() and json.loads(meta.read_text())["step"] == last:  # the state of the saved weights
        full = {k[len("model."):]: v for k, v in load_file(str(state)).items() if k.startswith("model.")}
        if full.keys() == saved.keys():
            saved = full
    return quantize_state_dict(saved, vector_dtype)


def install(src: Path, dst: Path, every: int, int8: bool = False) -> None:
    """Copy config.json, model.safetensors and README.md from src to dst and thin train_log.jsonl."""
    for name in ("config.json", "model.safetensors", "README.md", "train_log.jsonl"):
        if not (src / name).exists():
            raise FileNotFoundError(f"{src / name} is missing: is the training finished?")
    dst.mkdir(parents=True, exist_ok=True)
    if int8:
        cfg = json.loads((src / "config.json").read_text()) | {"quantization_config": quantization_config()}
        (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(int8_weights(src), str(dst / "model.safetensors"), metadata={"format": "pt"})
    else:
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
    if int8:
        card += ("- stored here as int8 matrices with float32 row scales (`--int8`, from the run's float32 weights); "
                 "loading dequantizes them.\n")
    (dst / "README.md").write_text(card)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--int8", action="store_true", help="store the matrices as int8 rows with float32 scales")
    args = parser.parse_args()
    install(args.src, args.dst, args.every, args.int8)


if __name__ == "__main__":
    main()
