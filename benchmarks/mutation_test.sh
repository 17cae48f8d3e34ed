#!/usr/bin/env bash
# Mutation testing of dspark's lossless core with mutmut (a benchmark, not run in CI).
#
#   bash benchmarks/mutation_test.sh            # fresh run: deletes ./mutants, mutates, tests, summarises
#   bash benchmarks/mutation_test.sh --resume   # keep ./mutants: reuse finished verdicts, test the rest
#
# mutmut (pip install mutmut==3.8.1) reads [tool.mutmut] in pyproject.toml: it mutates dspark/verify.py,
# dspark/sampling.py, dspark/scheduling.py and dspark/engine/engine.py into ./mutants/ and runs, for each
# mutant, the selected fast tests that reach the mutated function. This script tests the lossless-core
# functions only (SCOPE below: every mutant of the four files would take several hours on 2 CPU cores).
# It writes to benchmarks/results/mutation/:
#   summary.md       per-file and per-function counts, the mutation score, the command, the date, wall time
#   mutants.txt      every in-scope mutant with its status (the raw verdicts from mutants/*.meta)
#   mutmut_results.txt   `mutmut results --all true` as mutmut prints it (out-of-scope mutants: not checked)
#   survivors.diff   the diff of every surviving mutant (`mutmut show`)
#   run.log          mutmut's own output
# README.md there explains every surviving mutant. MUTMUT_CHILDREN (default 1) sets parallel workers.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=benchmarks/results/mutation
CHILDREN="${MUTMUT_CHILDREN:-1}"
SCOPE=(
    # verify.py: all of it
    "dspark.verify.x_verify__mutmut_*"
    # sampling.py: the logits -> distribution transform, Gumbel noise, generators (not SamplingParams' checks)
    "dspark.sampling.x_filter_logits__mutmut_*"
    "dspark.sampling.x_sampling_logits__mutmut_*"
    "dspark.sampling.x_probs_from_sampling_logits__mutmut_*"
    "dspark.sampling.x_logits_to_probs__mutmut_*"
    "dspark.sampling.x_gumbel_noise__mutmut_*"
    "dspark.sampling.x_make_generator__mutmut_*"
    "dspark.sampling.xǁBatchSamplingǁfrom_params__mutmut_*"
    # scheduling.py: the policies and Scheduler.plan (not the cost model's table, the back-off, parse_policy)
    "dspark.scheduling.x_step_tokens__mutmut_*"
    "dspark.scheduling.x__as_numpy__mutmut_*"
    "dspark.scheduling.x_fixed_lengths__mutmut_*"
    "dspark.scheduling.x_threshold_lengths__mutmut_*"
    "dspark.scheduling.x_batch_table_lengths__mutmut_*"
    "dspark.scheduling.x_admission_order__mutmut_*"
    "dspark.scheduling.x__path__mutmut_*"
    "dspark.scheduling.x__lengths_from__mutmut_*"
    "dspark.scheduling.x__plateau_room__mutmut_*"
    "dspark.scheduling.x__prefix_cut__mutmut_*"
    "dspark.scheduling.x_prefix_schedule__mutmut_*"
    "dspark.scheduling.x_best_capacity__mutmut_*"
    "dspark.scheduling.x_top_capacity__mutmut_*"
    "dspark.scheduling.x_cap_to_budget__mutmut_*"
    "dspark.scheduling.xǁSchedulerǁplan__mutmut_*"
    # engine.py: the commit / rollback path of a decoding round
    "dspark.engine.engine.xǁEngineǁ_decode_round__mutmut_*"
    "dspark.engine.engine.xǁEngineǁ_commit__mutmut_*"
    "dspark.engine.engine.xǁEngineǁ_leave__mutmut_*"
    "dspark.engine.engine.xǁEngineǁ_stop_ids__mutmut_*"
)

if ! command -v mutmut >/dev/null; then
    echo "mutmut is not installed: pip install mutmut==3.8.1" >&2
    exit 1
fi
if [[ "${1:-}" != "--resume" ]]; then
    rm -rf mutants
fi
mkdir -p "$OUT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
export PYTHONHASHSEED=0

started="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
t0=$(date +%s)
set +e
mutmut run --max-children "$CHILDREN" "${SCOPE[@]}" > "$OUT/run.raw" 2>&1
rc=$?
set -e
t1=$(date +%s)
# mutmut redraws its progress line with \r: keep the lines that are not progress
tr '\r' '\n' < "$OUT/run.raw" | grep -v '^[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏] ' > "$OUT/run.log" || true
rm -f "$OUT/run.raw"
if [[ $rc -ne 0 ]]; then
    tail -n 40 "$OUT/run.log" >&2
    echo "mutmut run failed (exit $rc)" >&2
    exit $rc
fi

mutmut results --all true > "$OUT/mutmut_results.txt"
python benchmarks/mutation_summary.py --out "$OUT" --started "$started" --seconds $((t1 - t0)) \
    --command "bash benchmarks/mutation_test.sh $*" --children "$CHILDREN" -- "${SCOPE[@]}"
cat "$OUT/summary.md"
