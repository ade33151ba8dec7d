#!/bin/bash
# The long-horizon run on one H200 (docs/RESULTS.md): the SFT cold start on the reference trajectories, with
# held-out pass@1 before and after, then critic PPO from the SFT checkpoint for what is left of TIME_S seconds
# (trainer.time_limit_action=finish: the run ends complete, final evaluation included). Start it detached:
#   bash launch/gpu/detached.sh start CALL_S lh 'SFT_ARGS="sft.epochs=8" bash launch/gpu/long_horizon.sh TIME_S [rl.train overrides]'
# and follow it with `bash launch/gpu/detached.sh watch CALL_S lh`. Each run's metrics, summary and curves come
# back under $RESULTS (sft_* and <run name>_*). Ablations are rl.train overrides, e.g. agent.compaction.enabled=false.
set -uo pipefail
source launch/gpu/setup.sh >/dev/null
TIME_S=$1; shift
ROOT=/tmp/rl-out/lh RESULTS=${RESULTS:-/tmp/rl-out/lh/results}
mkdir -p "$ROOT" "$RESULTS"
started=$SECONDS
collect() {  # RUN_DIR PREFIX
  for f in metrics.jsonl summary.json config.yaml curves.png; do [ -f "$1/$f" ] && cp "$1/$f" "$RESULTS/$2_$f"; done
  return 0
}
SFT=$ROOT/long_horizon_gpu_sft
if [ ! -f "$SFT/hf/config.json" ]; then
  # shellcheck disable=SC2086  # SFT_ARGS: space-separated Hydra overrides
  python3 -m rl.sft +experiment=long_horizon_gpu output_dir="$ROOT" "${SGLANG_OVERRIDES[@]}" ${SFT_ARGS:-} \
    || { echo "long_horizon: rl.sft failed"; collect "$SFT" sft; exit 1; }
  collect "$SFT" sft
fi
RUN_NAME=${RUN_NAME:-long_horizon_gpu}  # an ablation gets its own, e.g. RUN_NAME=lh_truncation
left=$((TIME_S - (SECONDS - started)))
echo "long_horizon: SFT done after $((SECONDS - started)) s; PPO gets $left s"
python3 -m rl.train +experiment=long_horizon_gpu model.name="$SFT/hf" output_dir="$ROOT" run_name="$RUN_NAME" \
  "${SGLANG_OVERRIDES[@]}" trainer.time_limit_s="$left" trainer.time_limit_action=finish "$@"
rc=$?
collect "$ROOT/$RUN_NAME" "$RUN_NAME"
exit $rc
