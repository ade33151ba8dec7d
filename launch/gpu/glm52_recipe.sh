#!/bin/bash
# The GLM-5.2 recipe's figures on the GPU machine (docs/BENCHMARKS.md, "The GLM-5.2 recipe"): coding_ppo_glm52
# for STEPS steps with routed-expert replay, then the same without it, one after the other in a session of its
# own that outlives the device call (while the machine stays warm); then, if asked, GPU tests on the same warm
# machine (its SGLang JIT cache is warm by then). `watch` follows it in back-to-back calls.
#   [REPLAYS="true false"] bash launch/gpu/glm52_recipe.sh start CALL_S STEPS [pytest -k expression]
#   bash launch/gpu/glm52_recipe.sh watch CALL_S
# Each call prints the log's new lines until everything ends or CALL_S seconds pass, then copies both runs'
# metrics and summaries (replay_true_*, replay_false_*) and the tests' report to $OUT. Run from the repo root.
set -uo pipefail
SGLANG_DENSE=0 source launch/gpu/setup.sh
VERB=$1 CALL_S=$2 STEPS=${3:-3} TESTS=${4:-}
ROOT=/tmp/rl-out/glm52 LOG=/tmp/rl-out/glm52.log PID=/tmp/rl-out/glm52.pid
mkdir -p $ROOT
if [ "$VERB" = start ]; then
  setsid bash -c "
    for replay in ${REPLAYS:-true false}; do
      echo \"=== coding_ppo_glm52, engine.return_routed_experts=\$replay\"
      python3 -m rl.train +experiment=coding_ppo_glm52 output_dir=$ROOT run_name=replay_\$replay \
        trainer.steps=$STEPS trainer.eval_at_start=false engine.return_routed_experts=\$replay ${SGLANG_OVERRIDES[*]}
      echo \"=== exit \$?\"
    done
    if [ -n '$TESTS' ]; then
      echo '=== GPU tests: $TESTS'
      RL_GPU_REPORT=$ROOT/gpu_tests.json python3 -m pytest -q -p no:cacheprovider tests/gpu/test_sglang_server.py -k '$TESTS'
      echo \"=== exit \$?\"
    fi" >"$LOG" 2>&1 </dev/null &
  echo $! >"$PID"
  echo 0 >"$LOG.shown"
fi
follow_log "$CALL_S"
follow_running && echo "glm52_recipe: still running" || echo "glm52_recipe: ended"
cp "$LOG" "${OUT:-/tmp}/glm52.log"
for run in $ROOT/replay_*; do
  [ -d "$run" ] || continue
  for f in metrics.jsonl summary.json; do [ -f "$run/$f" ] && cp "$run/$f" "${OUT:-/tmp}/$(basename "$run")_$f"; done
  [ -d "$run/sglang" ] && tail -n 40 "$run"/sglang/*.log >"${OUT:-/tmp}/$(basename "$run")_sglang_tail.log" 2>/dev/null
done
for f in $ROOT/gpu_tests.json $ROOT/gpu_tests.log; do [ -f "$f" ] && cp "$f" "${OUT:-/tmp}/"; done
exit 0
