#!/bin/bash
# Join a Ray cluster: ray_worker.sh HEAD_IP[:PORT]. Each node brings its GPUs; SGLang servers and trainer
# workers are placed on them by Ray (engine.sglang.gpus_per_server, trainer.actor_gpus, trainer.critic_gpus).
set -euo pipefail
HEAD=${1:?usage: ray_worker.sh HEAD_IP[:PORT]}
[[ "$HEAD" == *:* ]] || HEAD="$HEAD:${RAY_PORT:-6379}"
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0}
ray start --address="$HEAD" --num-gpus="$(nvidia-smi -L 2>/dev/null | wc -l)" --num-cpus="$(nproc)" \
  --disable-usage-stats --block
