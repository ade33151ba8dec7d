#!/bin/bash
# One device call's worth of coding_ppo_gpu (docs/RESULTS.md): run from the repo root on the GPU machine.
#   bash launch/gpu/train.sh LIMIT_S [hydra overrides...]   (LIMIT_S ~90 s under the call's limit: start-up, shutdown)
#   EXP=coding_ppo_gpu2 bash launch/gpu/train.sh ...         (two GPUs: trainer on one, SGLang on the other)
# Starts the run, or continues it from its last checkpoint (resume=true), and stops cleanly before LIMIT_S;
# copies the run's metrics, summary, config and curves to $OUT. Outputs live in /tmp/rl-out while the machine
# stays warm.
set -uo pipefail
source launch/gpu/setup.sh
LIMIT=${1:-480}; shift || true
EXP=${EXP:-coding_ppo_gpu}
RUN=/tmp/rl-out/$EXP
EXTRA=()  # the SGLang server processes get SGLang's carried site tree (and nothing else) on their path
[ -n "${RL_SGLANG_PYTHONPATH:-}" ] && EXTRA+=("+engine.sglang.env.PYTHONPATH=$RL_SGLANG_PYTHONPATH")
python3 -m rl.train +experiment=$EXP output_dir=/tmp/rl-out trainer.time_limit_s="$LIMIT" resume=true "${EXTRA[@]}" "$@" \
  2>&1 | grep --line-buffered -v -E "it/s\]|ep/s\]|Loading weights|Writing model shards" | tee "${OUT:-/tmp}/train.log"
status=${PIPESTATUS[0]}
[ -d "$RUN/sglang" ] && tail -n 60 "$RUN"/sglang/*.log > "${OUT:-/tmp}/sglang_tail.log" 2>/dev/null
for f in metrics.jsonl summary.json config.yaml curves.png; do [ -f "$RUN/$f" ] && cp "$RUN/$f" "${OUT:-/tmp}/"; done
[ -f "$RUN/guard_audit.jsonl" ] && tail -n 200 "$RUN/guard_audit.jsonl" > "${OUT:-/tmp}/guard_audit_tail.jsonl"
exit $status
