#!/usr/bin/env bash
# Calibrations shipped with the zoo's drafters (T 0 and T 1), with their before/after reports.
# Usage: bash benchmarks/calibrate_zoo.sh [DRAFTER ...]   (default: every bundled drafter and n-gram)
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/calibration
mkdir -p "$out"
drafters=("$@")
[ ${#drafters[@]} -eq 0 ] && drafters=(dspark dspark-rnn dflash eagle3 draft-model ngram)
for d in "${drafters[@]}"; do
  if [ "$d" = dspark ]; then n=40; else n=20; fi  # the headline drafter gets the larger held-out set
  dspark calibrate "$d" --temperatures 0 1 --fit-prompts "$n" --eval-prompts "$n" --max-new-tokens 128 \
      --batch-size 10 --plot-dir "$out" | tee "$out/$d.txt"
done
