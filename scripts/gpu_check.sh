#!/usr/bin/env bash
# The serving issue's GPU check, for a lent device machine (about 8 minutes): the step-cost profile on CUDA
# and a short load sweep over HTTP, into benchmarks/results/gpu/ (or $OUT/gpu when the device tool sets OUT).
#   bash scripts/gpu_check.sh
# Needs a CUDA build of torch (on the device machine: pip install -e ".[test]" without the CPU pin).
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${OUT:-benchmarks/results}/gpu"
mkdir -p "$dest"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" \
    | tee "$dest/device.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$dest/device.txt" || true
timeout 240 dspark profile --device cuda --batches 1 4 16 64 --out "$dest/profile_cuda.json" \
    --plot "$dest/profile_cuda.png" 2>&1 | tee "$dest/profile.log"
timeout 300 python benchmarks/serve_sweep.py --device cuda --profile "$dest/profile_cuda.json" \
    --arms none fixed:7 fixed:1 dspark --temperatures 0 --concurrency 1 8 64 --repeats 1 \
    --out "$dest" 2>&1 | tee "$dest/sweep.log"
