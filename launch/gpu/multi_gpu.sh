#!/bin/bash
# The multi-GPU measurements (docs/BENCHMARKS.md, "Several GPUs"), on whatever kind with N >= 2 GPUs a session is
# lent. Phases, each bench under its own time cap (a cap loses only what that bench had not finished: the benches
# rewrite their JSON after every world / every K):
#   scaling   bench/trainer_scaling.py at 1, 2, 4, (8) ranks on one global batch, plain data parallelism: the
#             default policy's shape (SmolLM2-135M, fp32, ZeRO-2; actor and critic), then the actor of a 1.3B
#             GLM-5.2-architecture model (glm52-1b-shape: bf16, ZeRO-2, gradient checkpointing)        ~10 min
#   parallel  the GLM-5.2 actor under E = k and S = k at each rank count k (largest first), and at one rank, each
#             with the longest one-sample update that trains (32K, 64K, ... up to 256K)              ~10-15 min
#   async     bench/async_loop.py, K = 0 and 1, 6 steps each: rl.train disaggregated (layout: `plan`), the
#             trainer groups on some GPUs and the SGLang servers on the others, weights over NCCL    ~15 min
#   plan      print what the phases would run here, and nothing else
# A session has 30 minutes of device time, so the phases take two sessions' worth: scaling and parallel need only
# the stack (random weights of a shape), async also SGLang and the policy. Device calls (each carries one part,
# see launch/gpu/build_carry.sh; every call within 30 s of the last):
#   session A: call 1 carries .carry/stack:  bash launch/gpu/detached.sh start 540 mg 'bash launch/gpu/multi_gpu.sh scaling parallel'
#              calls 2-4:                    bash launch/gpu/detached.sh watch 560 mg
#   session B: calls 1-4 carry .carry/stack, the SGLang parts, gguf0, gguf1 (any command, e.g. the plan);
#              call 5 carries gguf2:         bash launch/gpu/detached.sh start 540 mga 'bash launch/gpu/multi_gpu.sh async'
#              then:                         bash launch/gpu/detached.sh watch 560 mga
# Results (JSON and logs) come back in the NAME-results.tar of each call. Exit status 1 if any bench failed.
set -uo pipefail
N=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
RESULTS=${RESULTS:-/tmp/rl-out/multi_gpu}
if [ "$N" -lt 2 ]; then
  echo "multi_gpu: $N GPU(s) here; these measurements need 2 or more" >&2
  exit 2
fi
RANKS=(1 2); [ "$N" -ge 4 ] && RANKS+=(4); [ "$N" -ge 8 ] && RANKS+=(8)
# The asynchronous loop's layout. The NCCL broadcast's group (the actor's rank 0 and every server) may not have two
# members on one GPU, so every server gets a GPU of its own; two or more servers from 4 GPUs on, and the actor
# sharded over several ranks at 8.
if [ "$N" -ge 8 ]; then
  ASYNC=(trainer.actor_ranks=4 trainer.actor_gpus=1 trainer.critic_ranks=2 trainer.critic_gpus=1
         engine.sglang.num_servers=2 engine.sglang.gpus_per_server=1)
elif [ "$N" -ge 4 ]; then
  ASYNC=(trainer.actor_ranks=1 trainer.actor_gpus=1 trainer.critic_ranks=1 trainer.critic_gpus=1
         engine.sglang.num_servers=2 engine.sglang.gpus_per_server=1)
else  # coding_ppo_2gpu_disaggregated as it is: actor and critic share one GPU, one server on the other
  ASYNC=(engine.sglang.num_servers=1 engine.sglang.gpus_per_server=1)
fi
# (the recipe's HumanEval transfer check is left out: 164 more episodes in the final step would swamp 6 steps)
ASYNC+=(trainer.zero_stage=3 engine.sglang.weight_sync=distributed engine.max_concurrent_episodes=64 env.extra_eval_tasks=)
GLM=(python3 bench/trainer_scaling.py --model glm52-1b-shape --dtype bfloat16 --zero 2 --checkpointing --layouts packed
     --samples 32 --lengths 1024 4096 --micro-batch-tokens 32768 --gpus-per-rank 1 --roles actor)
FAILED=0

run() {  # CAP_S NAME COMMAND...: one bench, its output to the log and $RESULTS/NAME.log, stopped after CAP_S
  local cap=$1 name=$2; shift 2
  echo "=== $name ($(date +%T), cap ${cap}s): $*"
  [ -n "${DRY:-}" ] && return 0
  mkdir -p "$RESULTS"
  timeout --signal=INT --kill-after=30 "$cap" "$@" 2>&1 | tee "$RESULTS/$name.log"
  local status=${PIPESTATUS[0]}
  echo "=== $name exit $status"
  if [ "$status" != 0 ]; then
    FAILED=1
    # a bench cut short can leave Ray's processes and SGLang's servers (and the GPU memory they hold) behind
    pkill -9 -f 'ray::|raylet|gcs_server|sglang.launch_server|sglang::' 2>/dev/null || true
  fi
}

for phase in "$@"; do
  case $phase in
  plan) echo "GPUs $N; ranks ${RANKS[*]}; async ${ASYNC[*]}" ;;
  scaling)
    run 300 scaling_smollm2 python3 bench/trainer_scaling.py --model smollm2-shape --ranks "${RANKS[@]}" --zero 2 \
      --layouts packed --samples 128 --lengths 256 2048 --micro-batch-tokens 32768 --gpus-per-rank 1 \
      --out "$RESULTS/scaling_smollm2.json"
    run 300 scaling_glm52 "${GLM[@]}" --ranks "${RANKS[@]}" --out "$RESULTS/scaling_glm52.json" ;;
  parallel)  # largest count first: a session that runs out of time loses the smaller ones
    for k in $(printf '%s\n' "${RANKS[@]}" | sort -rn); do
      layouts=("${k}x1" "1x${k}"); [ "$k" = 1 ] && layouts=("1x1")
      run 300 "parallel_glm52_$k" "${GLM[@]}" --ranks "$k" --parallel "${layouts[@]}" --steps 2 \
        --longest 32768 --longest-timeout 120 --out "$RESULTS/parallel_glm52_$k.json"
    done ;;
  async)
    source launch/gpu/setup.sh >/dev/null
    run 1200 async_disaggregated python3 bench/async_loop.py --experiment coding_ppo_2gpu_disaggregated --steps 6 \
      --ks 0 1 --out "$RESULTS/async_disaggregated.json" --run-dir /tmp/rl-out/async_mg -- trainer.eval_max_tasks=4 \
      "${ASYNC[@]}" "${SGLANG_OVERRIDES[@]}"
    for d in /tmp/rl-out/async_mg/*/; do
      [ -f "$d/metrics.jsonl" ] && cp "$d/metrics.jsonl" "$RESULTS/$(basename "$d")_metrics.jsonl"
    done ;;
  *) echo "multi_gpu: unknown phase $phase (scaling, parallel, async, plan)" >&2; exit 2 ;;
  esac
done
exit "$FAILED"
