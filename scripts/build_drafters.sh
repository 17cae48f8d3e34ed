#!/usr/bin/env bash
# Train the four drafters of the zoo for the bundled target on the same target-regenerated data and budget.
# Needs data/corpus (scripts/build_corpus.py) and the bundled target and draft model (scripts/build_zoo.sh).
# For several processes: replace `dspark train` by `torchrun --nproc-per-node N -m dspark.cli train`.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${PROMPTS:-800}    # prompts per domain
STEPS=${STEPS:-600}
dspark regenerate data/corpus/code_train.jsonl data/corpus/prose_train.jsonl data/corpus/math_train.jsonl \
    --limit "$PROMPTS" --out data/regen/train.jsonl --max-new-tokens 160 --drafter draft-model
for kind in dspark dflash eagle3 dspark-rnn; do
    dspark train "$kind" --data data/regen/train.jsonl --out "zoo/$kind" --steps "$STEPS" --batch 8 --layers 1 --lr 1e-3
done
