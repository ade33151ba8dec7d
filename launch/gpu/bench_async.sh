#!/bin/bash
# bench/async_loop.py on the GPU machine across back-to-back device calls (docs/BENCHMARKS.md, "Asynchronous
# loop"): K = 0, 1, 2 are three fresh rl.train runs of 5-10 minutes each, longer than one call, so `start` runs the
# benchmark in a session of its own (it lives on while the machine stays warm) and `watch` follows it.
#   bash launch/gpu/bench_async.sh start CALL_S [bench args...] [-- hydra overrides...]
#   bash launch/gpu/bench_async.sh watch CALL_S
# Each call prints the log's new lines until the benchmark ends or CALL_S seconds pass, then copies its log and
# result (async_gpu.json) to $OUT. Run from the repo root.
set -uo pipefail
source launch/gpu/setup.sh
VERB=$1 CALL_S=$2; shift 2
LOG=/tmp/rl-out/bench_async.log PID=/tmp/rl-out/bench_async.pid RESULT=/tmp/rl-out/async_gpu.json
mkdir -p /tmp/rl-out
if [ "$VERB" = start ]; then
  setsid python3 bench/async_loop.py --out "$RESULT" --run-dir /tmp/rl-out/async "$@" "${SGLANG_OVERRIDES[@]}" \
    >"$LOG" 2>&1 </dev/null &
  echo $! >"$PID"
  echo 0 >"$LOG.shown"
fi
follow_log "$CALL_S"
follow_running && echo "bench_async: still running" || echo "bench_async: ended"
cp "$LOG" "${OUT:-/tmp}/bench_async.log"
[ -f "$RESULT" ] && cp "$RESULT" "${OUT:-/tmp}/"
for d in /tmp/rl-out/async/*/; do [ -f "$d/metrics.jsonl" ] && cp "$d/metrics.jsonl" "${OUT:-/tmp}/$(basename "$d")_metrics.jsonl"; done
exit 0
