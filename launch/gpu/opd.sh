#!/bin/bash
# Parallel OPD on one GPU (docs/OPD.md): the two experts (python -m opd.experts, on the GPU), then opd.distill
# +experiment=opd_merge_gpu (SGLang teachers, 64 episodes a step) for what is left of TIME_S seconds
# (trainer.time_limit_action=finish: the run ends complete, final evaluation included). Start it detached:
#   bash launch/gpu/detached.sh start CALL_S opd 'bash launch/gpu/opd.sh TIME_S [opd.distill overrides]'
# and follow it with `bash launch/gpu/detached.sh watch CALL_S opd`; metrics, summary and curves come back.
# RUNS (one `run_name|overrides` a line) runs several distillations from the same experts at the same time, each
# with its own Ray and SGLang servers on the GPU (give them equal trainer.steps: the same budget), e.g. pure OPD
# against OPD added to critic-PPO advantages:
#   RUNS=$'opd_merge_gpu|\nopd_merge_gpu_ppo|opd.mode=ppo_opd trainer.critic_gpus=0.1 opd.eval_teachers=false'
# Several runs share the GPU: each gets micro-batches of 8,192 positions and 5% of the free memory for each of its
# three SGLang servers first (overrides after TIME_S still win; docs/SGLANG.md, "Several servers on one GPU").
set -uo pipefail
source launch/gpu/setup.sh >/dev/null
TIME_S=$1; shift
ROOT=/tmp/rl-out/opd RESULTS=${RESULTS:-/tmp/rl-out/opd/results}
RUNS=${RUNS:-opd_merge_gpu|}
shared_gpu_args 8192 0.05
mkdir -p "$ROOT" "$RESULTS"
started=$SECONDS
for spec in function:1 bugfix:2; do  # domain:epochs, as the CPU demonstration made them
  domain=${spec%%:*} epochs=${spec##*:}
  [ -f "outputs/experts_gpu/$domain/config.json" ] && continue
  python3 -m opd.experts --domain "$domain" --out "outputs/experts_gpu/$domain" --epochs "$epochs" \
    || { echo "opd: the $domain expert failed"; exit 1; }
done
left=$((TIME_S - (SECONDS - started)))
echo "opd: experts ready after $((SECONDS - started)) s; the distillation gets $left s"
collect() { collect_results "$ROOT/$1" "$1"; }  # RUN_NAME: its files and its servers' logs → $RESULTS
start_runs python3 -m opd.distill +experiment=opd_merge_gpu output_dir="$ROOT" "${SGLANG_OVERRIDES[@]}" "${SHARED_ARGS[@]}" \
  trainer.time_limit_s="$left" trainer.time_limit_action=finish "$@"
wait_runs opd collect
