#!/usr/bin/env bash
# Train the four drafters of the zoo for the bundled target on the same target-regenerated data and budget.
# Needs data/corpus (scripts/build_corpus.py) and the bundled target and draft model (scripts/build_zoo.sh).
# Same data and the same compute budget for every drafter: about 90 minutes of one CPU thread each, which
# buys 5000 steps of a block drafter, 4000 of DSpark-RNN (its head unrolls over the block) and 2700 of
# EAGLE-3 (training-time test unrolls 7 draft steps). Two trainings run side by side with one thread each
# (on 2 cores this beats one run with two threads). A killed run resumes from its checkpoint when the
# same command runs again.
# For several processes: replace `dspark train` by `torchrun --nproc-per-node N -m dspark.cli train`.
set -euo pipefail
cd "$(dirname "$0")/.."
FIRST=${FIRST:-800}     # prompts per domain of the first regeneration
MORE=${MORE:-2200}      # further prompts per domain
T1=${T1:-2200}          # prompts per domain answered again at temperature 1 (the bench samples at T 0 and 1)
STEPS=${STEPS:-5000}          # block drafters (DFlash, DSpark)
RNN_STEPS=${RNN_STEPS:-4000}
EAGLE_STEPS=${EAGLE_STEPS:-2700}
LAYERS=${LAYERS:-2}     # draft layers of the block drafters (EAGLE-3 has one, as in its paper)
MLP=${MLP:-480}         # their MLP width (half the target's; keeps the zoo within 60 MB)
# DSpark's Markov head has rank 256 (benchmarks/results/rank/); it and DSpark-RNN are stored int8 to fit 60 MB.
CORPUS="data/corpus/code_train.jsonl data/corpus/prose_train.jsonl data/corpus/math_train.jsonl"
# Target-only decoding at batch 64 regenerates fastest on a CPU; any drafter gives the same distribution.
dspark regenerate $CORPUS --limit "$FIRST" --out data/regen/train.jsonl --max-new-tokens 160 --drafter draft-model
dspark regenerate $CORPUS --skip "$FIRST" --limit "$MORE" --out data/regen/extra.jsonl --max-new-tokens 160 \
    --drafter none --batch-size 64 --seed 100000
dspark regenerate $CORPUS --limit "$T1" --temperature 1.0 --top-k 0 --top-p 1.0 --out data/regen/t1.jsonl \
    --max-new-tokens 160 --drafter none --batch-size 64 --seed 200000
cat data/regen/train.jsonl data/regen/extra.jsonl data/regen/t1.jsonl > data/regen/all.jsonl
# One target pass over the data, cached for all four trainings (about 7.4 GB of bf16 features). The zoo's
# drafters were trained before the cache existed, with the target run at every step; the cache trains
# the same weights bit for bit (tests/test_feature_cache.py), faster (benchmarks/results/feature_cache.txt).
dspark cache-features --data data/regen/all.jsonl --out data/features
train() {  # kind, steps, extra args
    local kind=$1 steps=$2; shift 2
    OMP_NUM_THREADS=1 dspark train "$kind" --data data/regen/all.jsonl --out "zoo/$kind" --steps "$steps" --batch 8 \
        --lr 1e-3 --feature-cache data/features "$@" > "data/train_$kind.log" 2>&1
}
(train dspark "$STEPS" --layers "$LAYERS" --intermediate-size "$MLP" --markov-rank 256 --int8; \
    train eagle3 "$EAGLE_STEPS") &
(train dflash "$STEPS" --layers "$LAYERS" --intermediate-size "$MLP"; \
    train dspark-rnn "$RNN_STEPS" --layers "$LAYERS" --intermediate-size "$MLP" --int8) &
wait
