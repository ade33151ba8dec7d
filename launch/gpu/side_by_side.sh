#!/bin/bash
# Several rl.train runs of one experiment side by side on one GPU, each with its own Ray and SGLang server, for
# comparisons at the same number of samples (give every run the same trainer.steps; the time limit only stops a
# run that would not finish). Each RUN is `run_name|its overrides`; the overrides after `--` go to every run.
# Start it detached and follow it:
#   bash launch/gpu/detached.sh start CALL_S sbs 'bash launch/gpu/side_by_side.sh TIME_S EXPERIMENT RUN... [-- overrides]'
#   bash launch/gpu/detached.sh watch CALL_S sbs
# The asynchronous loop's learning comparison (docs/RESULTS.md, "Synchronous (K = 0) against asynchronous"):
#   bash launch/gpu/side_by_side.sh 1100 coding_ppo_gpu_sglang 'k0|trainer.max_staleness=0' \
#     'k2|trainer.max_staleness=2' -- trainer.learning_rate=2e-5 trainer.steps=24 trainer.eval_samples=8
# Side by side the runs share the GPU's time, so their seconds a step measure nothing alone (bench/async_loop.py
# times each K on its own). Each run gets SHARED_ARGS first (micro-batches of 8,192 positions, 8% of the free memory
# for its server; overrides after EXPERIMENT still win) and ends complete (trainer.time_limit_action=finish, final
# evaluation included); its metrics, summary, config, curves and server logs come back under $RESULTS as
# <run name>_*, and all the runs' curves on one figure as compare_curves.png.
set -uo pipefail
source launch/gpu/setup.sh >/dev/null
TIME_S=$1 EXPERIMENT=$2; shift 2
ROOT=${ROOT:-/tmp/rl-out/sbs} RESULTS=${RESULTS:-/tmp/rl-out/sbs/results}
RUNS=""
while [ $# -gt 0 ] && [ "$1" != -- ]; do RUNS+="$1"$'\n'; shift; done
[ $# -gt 0 ] && shift  # the --
[ -n "$RUNS" ] || { echo "side_by_side: no RUN given (run_name|overrides)" >&2; exit 2; }
shared_gpu_args 8192 0.08
mkdir -p "$ROOT" "$RESULTS"
collect_run() { collect_results "$ROOT/$1" "$1"; }  # RUN_NAME → $RESULTS
start_runs python3 -m rl.train +experiment="$EXPERIMENT" output_dir="$ROOT" "${SGLANG_OVERRIDES[@]}" "${SHARED_ARGS[@]}" \
  trainer.time_limit_s="$TIME_S" trainer.time_limit_action=finish "$@"
wait_runs side_by_side collect_run; rc=$?
# the runs' curves on one figure, $RESULTS/compare_curves.png (each run's own curves.png comes back too)
COMPARE=()
for name in "${RUN_NAMES[@]}"; do
  [ -f "$RESULTS/${name}_metrics.jsonl" ] && COMPARE+=("$name=$RESULTS/${name}_metrics.jsonl")
done
[ ${#COMPARE[@]} -ge 2 ] && python3 -m rl.run_log compare "${COMPARE[@]}" --out "$RESULTS/compare_curves.png"
exit $rc
