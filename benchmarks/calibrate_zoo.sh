#!/usr/bin/env bash
# Calibrations shipped with the zoo's drafters (T 0 and T 1), with their before/after reports.
# Usage: bash benchmarks/calibrate_zoo.sh [DRAFTER ...]   (default: every bundled drafter and n-gram)
#
# Prompts: every held-out prompt of the training corpus (data/corpus/*_heldout.jsonl, rebuilt here if
# missing: code 478, prose 247, math 1579 distinct prompts), each domain's even-numbered prompts scored and
# odd-numbered ones fitted. Rounds are kept in data/calibration_records/ so a refit
# (`dspark calibrate D --from-records data/calibration_records`) needs no decoding. Greedy rows' peaks are
# recorded but not fitted (--ignore-greedy-peaks): the shipped T 0 maps of drafters without a confidence head
# give greedy rows a per-position prior (why: docs/scheduling.md, "Greedy peaks").
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/calibration
records=data/calibration_records
mkdir -p "$out" "$records"
if [ ! -f data/corpus/math_heldout.jsonl ]; then
  python scripts/build_corpus.py --out data/corpus --eval-prompts data/corpus/eval_prompts
fi
drafters=("$@")
[ ${#drafters[@]} -eq 0 ] && drafters=(dspark dspark-rnn dflash eagle3 draft-model ngram)
for d in "${drafters[@]}"; do
  if [ "$d" = dspark ]; then n=256; else n=128; fi  # the headline drafter gets the longer rounds
  OMP_NUM_THREADS=1 dspark calibrate "$d" --temperatures 0 1 --max-new-tokens "$n" --batch-size 10 --ignore-greedy-peaks \
      --prompts data/corpus/code_heldout.jsonl data/corpus/prose_heldout.jsonl data/corpus/math_heldout.jsonl \
      --records-dir "$records" --plot-dir "$out" | tee "$out/$d.txt"
done
