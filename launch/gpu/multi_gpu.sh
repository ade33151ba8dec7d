#!/bin/bash
# The multi-GPU measurements (docs/BENCHMARKS.md, "Several GPUs"), on whatever kind with N >= 2 GPUs a session is
# lent, as few device calls as the carry allows. Phases, each a bench run under its own time cap:
#   scaling   bench/trainer_scaling.py, the default policy's shape (SmolLM2-135M, fp32, ZeRO-2) at 1, 2, 4, (8) ranks on
#             one global batch; and the same at one rank with TF32 matmuls
#   parallel  the actor's update of a 1.3B GLM-5.2-architecture model (bf16, ZeRO-2, gradient checkpointing) at 1, 2,
#             4, (8) ranks under every expert x sequence layout that divides the count (plain, E = k, S = k, 2x2),
#             and for each the longest one-sample update that trains (16K, 32K, ... until one fails)
#   async     bench/async_loop.py, K = 0 and 1: rl.train disaggregated, the trainer groups on some GPUs and two
#             SGLang servers behind sglang-router on the others, weights moved over NCCL (layout: `plan`)
#   plan      print what the phases would run here, and nothing else
# Needs only the stack for scaling and parallel (random weights of a shape); async needs SGLang and the policy too.
# The device calls (each carries one part, see launch/gpu/build_carry.sh; every call within 30 s of the last):
#   1 carry .carry/stack:                         bash launch/gpu/detached.sh start 540 mg 'bash launch/gpu/multi_gpu.sh scaling parallel'
#   2-4 carry the SGLang parts and gguf0, gguf1:  bash launch/gpu/detached.sh watch 300 mg
#   5 carry gguf2, once mg has ended:             bash launch/gpu/detached.sh start 540 mga 'bash launch/gpu/multi_gpu.sh async'
#   6 (if needed):                                bash launch/gpu/detached.sh watch 540 mga
# Results (JSON, logs, per-step metrics) come back in the NAME-results.tar of each call.
set -uo pipefail
N=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
RESULTS=${RESULTS:-/tmp/rl-out/multi_gpu}
mkdir -p "$RESULTS"
if [ "$N" -lt 2 ]; then
  echo "multi_gpu: $N GPU(s) here; these measurements need 2 or more" >&2
  exit 2
fi
RANKS=(1 2); [ "$N" -ge 4 ] && RANKS+=(4); [ "$N" -ge 8 ] && RANKS+=(8)
TOP=${RANKS[-1]}
LAYOUTS=("1x1"); for k in "${RANKS[@]:1}"; do LAYOUTS+=("${k}x1" "1x${k}"); done
[ "$TOP" -ge 4 ] && LAYOUTS+=("2x2")
# The asynchronous loop's layout: servers get whole GPUs where there are enough, else share one (0.5 each).
if [ "$N" -ge 8 ]; then
  ASYNC=(trainer.actor_ranks=4 trainer.actor_gpus=1 trainer.critic_ranks=2 trainer.critic_gpus=1
         engine.sglang.num_servers=2 engine.sglang.gpus_per_server=1)
elif [ "$N" -ge 4 ]; then
  ASYNC=(trainer.actor_ranks=2 trainer.actor_gpus=1 trainer.critic_ranks=1 trainer.critic_gpus=1
         engine.sglang.num_servers=2 engine.sglang.gpus_per_server=0.5 ++engine.sglang.args.mem-fraction-static=0.35)
else
  ASYNC=(trainer.actor_ranks=1 trainer.actor_gpus=0.5 trainer.critic_ranks=1 trainer.critic_gpus=0.4
         engine.sglang.num_servers=2 engine.sglang.gpus_per_server=0.5 ++engine.sglang.args.mem-fraction-static=0.35)
fi
# (the recipe's HumanEval transfer check is left out: 164 more episodes in the final step would swamp 5 steps)
ASYNC+=(trainer.zero_stage=3 engine.sglang.weight_sync=distributed engine.max_concurrent_episodes=64 env.extra_eval_tasks=)

run() {  # CAP_S NAME COMMAND...: one bench, its output to the log and $RESULTS/NAME.log, killed after CAP_S
  local cap=$1 name=$2; shift 2
  echo "=== $name ($(date +%T), cap ${cap}s): $*"
  [ -n "${DRY:-}" ] && return 0
  timeout --signal=INT --kill-after=30 "$cap" "$@" 2>&1 | tee "$RESULTS/$name.log"
  local status=${PIPESTATUS[0]}
  echo "=== $name exit $status"
  # a bench cut short can leave Ray's processes (and the GPU memory they hold) behind: the next phase needs the GPUs
  [ "$status" = 0 ] || pkill -9 -f 'ray::|raylet|gcs_server|sglang' 2>/dev/null || true
}

for phase in "$@"; do
  case $phase in
  plan) echo "GPUs $N; ranks ${RANKS[*]}; layouts ${LAYOUTS[*]}; async ${ASYNC[*]}" ;;
  scaling)
    run 480 scaling_smollm2 python3 bench/trainer_scaling.py --model smollm2-shape --ranks "${RANKS[@]}" --zero 2 \
      --layouts packed --samples 128 --lengths 256 2048 --micro-batch-tokens 32768 --gpus-per-rank 1 \
      --out "$RESULTS/scaling_smollm2.json"
    run 180 scaling_smollm2_tf32 python3 bench/trainer_scaling.py --model smollm2-shape --ranks 1 --layouts packed \
      --roles actor \
      --samples 128 --lengths 256 2048 --micro-batch-tokens 32768 --gpus-per-rank 1 --matmul fp32 tf32 \
      --out "$RESULTS/scaling_smollm2_tf32.json" ;;
  parallel)  # the actor only; ranks 1 first (the ratios' base), then the largest count first (a cap cuts the least)
    run 1080 parallel_glm52 python3 bench/trainer_scaling.py --model glm52-1b-shape --dtype bfloat16 --zero 2 \
      --checkpointing --layouts packed --samples 32 --lengths 1024 4096 --micro-batch-tokens 32768 --gpus-per-rank 1 \
      --roles actor --ranks 1 $(printf '%s\n' "${RANKS[@]:1}" | sort -rn) --parallel "${LAYOUTS[@]}" \
      --longest 16384 --longest-timeout 150 --out "$RESULTS/parallel_glm52.json" ;;
  async)
    source launch/gpu/setup.sh >/dev/null
    run 1500 async_disaggregated python3 bench/async_loop.py --experiment coding_ppo_2gpu_disaggregated --steps 5 \
      --ks 0 1 --out "$RESULTS/async_disaggregated.json" --run-dir /tmp/rl-out/async_mg -- trainer.eval_max_tasks=4 \
      "${ASYNC[@]}" "${SGLANG_OVERRIDES[@]}"
    for d in /tmp/rl-out/async_mg/*/; do
      [ -f "$d/metrics.jsonl" ] && cp "$d/metrics.jsonl" "$RESULTS/$(basename "$d")_metrics.jsonl"
    done ;;
  *) echo "multi_gpu: unknown phase $phase (scaling, parallel, async, plan)" >&2; exit 2 ;;
  esac
done
