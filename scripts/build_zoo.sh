#!/usr/bin/env bash
# Rebuild the bundled zoo from text on this machine: corpus, tokenizer, target and draft model.
# Seeded throughout; prints corpus sizes and sha256 hashes. About 45 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
python scripts/build_corpus.py --out data/corpus --eval-prompts zoo/eval_prompts --seed 0
python scripts/build_tokenizer.py --corpus data/corpus --out data/tokenizer
python scripts/train_lm.py --name dspark-target --out zoo/target \
    --layers 12 --hidden 320 --heads 5 --kv-heads 1 --intermediate 960 --tokens 5e6
python scripts/train_lm.py --name dspark-draft --role "the draft model of classic speculative decoding" \
    --out zoo/draft-model --layers 1 --hidden 320 --heads 5 --kv-heads 1 --intermediate 960 --tokens 4e6
python benchmarks/forward_cost.py zoo/target zoo/draft-model
