#!/bin/bash
# Start the Ray head on this node (the driver runs here too). Then, on every other node: ray_worker.sh HEAD_IP.
# Afterwards: python -m rl.train +experiment=... trainer.ray_address=auto
set -euo pipefail
PORT=${RAY_PORT:-6379}
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
# NCCL weight sync from the trainer to SGLang servers on other GPUs (rollout/sglang/weights.py says why)
export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0}
ray start --head --port="$PORT" --num-gpus="$(nvidia-smi -L 2>/dev/null | wc -l)" --num-cpus="$(nproc)" \
  --include-dashboard=false --disable-usage-stats
echo "Ray head at $(hostname -I | awk '{print $1}'):$PORT"
