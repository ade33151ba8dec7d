#!/bin/bash
# One device call's worth of coding_ppo_gpu (docs/RESULTS.md): run from the repo root on the GPU machine.
#   bash launch/gpu/train.sh LIMIT_S [hydra overrides...]   (LIMIT_S ~90 s under the call's limit: start-up, shutdown)
#   EXP=coding_ppo_2gpu_disaggregated bash launch/gpu/train.sh ...         (two GPUs: trainer on one, SGLang on the other)
# Starts the run, or continues it from its last checkpoint (resume=true), and stops cleanly before LIMIT_S;
# copies the run's metrics, summary, config and curves to $OUT. Outputs live in /tmp/rl-out while the machine
# stays warm.
set -uo pipefail
source launch/gpu/setup.sh
LIMIT=${1:-480}; shift || true
EXP=${EXP:-coding_ppo_gpu}
RUN=/tmp/rl-out/$EXP
python3 -m rl.train +experiment=$EXP output_dir=/tmp/rl-out trainer.time_limit_s="$LIMIT" resume=true "${SGLANG_OVERRIDES[@]}" "$@" \
  2>&1 | grep --line-buffered -v -E "it/s\]|ep/s\]|Loading weights|Writing model shards" | tee "${OUT:-/tmp}/train.log"
status=${PIPESTATUS[0]}
copy_run_outputs "$RUN"
exit $status
