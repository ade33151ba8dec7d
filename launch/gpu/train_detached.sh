#!/bin/bash
# One coding_ppo run across several back-to-back device calls without restarting it (docs/RESULTS.md).
#   EXP=coding_ppo_2gpu_disaggregated bash launch/gpu/train_detached.sh start CALL_S [hydra overrides...]
#   EXP=coding_ppo_2gpu_disaggregated bash launch/gpu/train_detached.sh watch CALL_S
# The device machine ends a call's processes when it returns, except those in a session of their own: `start`
# launches rl.train with setsid, so the run (Ray, the trainer, the SGLang server) lives on while the machine stays
# warm, and each later call only `watch`es it. This saves what a resumed run pays per call (SGLang's start,
# DeepSpeed's set-up, the checkpoint load: 2-3 minutes). Give the run its end with trainer.time_limit_s and
# trainer.time_limit_action=finish, so it ends complete (final evaluation included) before the device time does.
# Both verbs print the log's new lines until the run ends or CALL_S seconds pass, then copy the run's metrics,
# summary, config and curves to $OUT. Run from the repo root on the GPU machine.
set -uo pipefail
source launch/gpu/setup.sh
VERB=$1 CALL_S=$2; shift 2
EXP=${EXP:-coding_ppo_gpu}
RUN=/tmp/rl-out/$EXP LOG=/tmp/rl-out/$EXP.log PID=/tmp/rl-out/$EXP.pid
mkdir -p /tmp/rl-out
if [ "$VERB" = start ]; then
  setsid python3 -m rl.train +experiment=$EXP output_dir=/tmp/rl-out "${SGLANG_OVERRIDES[@]}" "$@" >"$LOG" 2>&1 </dev/null &
  echo $! >"$PID"
  echo 0 >"$LOG.shown"
fi
follow_log "$CALL_S"
follow_running && echo "train_detached: still running (pid $(cat "$PID"))" || echo "train_detached: the run has ended"
copy_run_outputs "$RUN"
cp "$LOG" "${OUT:-/tmp}/train.log"
exit 0
