#!/bin/bash
# The long-horizon runs on one H200 (docs/RESULTS.md): the SFT cold start on the reference trajectories, with
# held-out pass@1 before and after, then critic PPO from the SFT checkpoint for what is left of TIME_S seconds
# (trainer.time_limit_action=finish: each run ends complete, final evaluation included). Start it detached:
#   bash launch/gpu/detached.sh start CALL_S lh 'SFT_ARGS="sft.epochs=8" bash launch/gpu/long_horizon.sh TIME_S [overrides]'
# and follow it with `bash launch/gpu/detached.sh watch CALL_S lh`. RUNS (one `run_name|overrides` a line) runs
# several PPO runs from the one SFT checkpoint at the same time, each with its own Ray and SGLang server on the
# GPU (give them equal trainer.steps: the same budget of samples), e.g. the run and its two ablations:
#   RUNS=$'long_horizon_gpu|\nlh_truncation|agent.compaction.enabled=false\nlh_per_segment|algorithm.chain_segments=false'
# The overrides after TIME_S go to every run. Each run's metrics, summary and curves come back under $RESULTS
# (sft_* and <run name>_*). EXPERIMENT picks the experiment (long_horizon_gpu; long_horizon_gen_gpu: the generated
# tasks; long_horizon_gen_split_gpu: the SFT on lh_sft, RL on lh_rl). With several runs the GPU is shared, so
# each run (and the SFT) gets SHARED_ARGS first (overrides after TIME_S still win): micro-batches of 8,192
# positions (at 32,768 a trainer process held about 52 GB) and 8% of the free memory for each SGLang server (plenty
# for the 135M policy; docs/SGLANG.md, "Several servers on one GPU"). A fresh SFT checkpoint is packed for the next
# session (launch/gpu/hf_carry.sh); one carried in from an earlier session is used instead of a new SFT. One run
# (no RUNS) goes on over sessions: its final checkpoint is packed at the end (HF_CARRY_NAME=ckpt, its two models
# as differences from the SFT checkpoint), and where an earlier session's arrived (setup.sh unpacks it into the
# run's checkpoints/), the run resumes from it (resume=true trainer.resume_weights_only=true) up to trainer.steps.
set -uo pipefail
source launch/gpu/setup.sh >/dev/null
TIME_S=$1; shift
ROOT=/tmp/rl-out/lh RESULTS=${RESULTS:-/tmp/rl-out/lh/results}
EXPERIMENT=${EXPERIMENT:-long_horizon_gpu}
RUNS=${RUNS:-$EXPERIMENT|}
# One run (not several side by side) goes on over sessions: its folder, and the seconds kept at the end for packing
# its final checkpoint (PACK_S=0 packs nothing)
ONE_RUN=$([ "$(grep -c . <<<"$RUNS")" = 1 ] && echo "$ROOT/${RUNS%%|*}")
PACK_S=${PACK_S:-$([ -n "$ONE_RUN" ] && echo 60 || echo 0)}
shared_gpu_args 8192 0.08
mkdir -p "$ROOT" "$RESULTS"
started=$SECONDS
collect() {  # RUN_DIR [PREFIX]: collect_results (setup.sh) and the decoded episodes → $RESULTS (the logs say where a
  # server's start-up went: 92-153 s of a session so far)
  local prefix=${2:-$(basename "$1")}
  collect_results "$1" "$prefix"
  [ -d "$1/episodes" ] && tar -C "$1" -cJf "$RESULTS/${prefix}_episodes.tar.xz" episodes
  return 0
}
collect_run() { collect "$ROOT/$1"; }
SFT=$ROOT/${EXPERIMENT}_sft
if [ ! -f "$SFT/hf/config.json" ]; then
  # shellcheck disable=SC2086  # SFT_ARGS: space-separated Hydra overrides
  python3 -m rl.sft +experiment="$EXPERIMENT" output_dir="$ROOT" "${SGLANG_OVERRIDES[@]}" "${SHARED_ARGS[@]}" ${SFT_ARGS:-} \
    || { echo "long_horizon: rl.sft failed"; collect "$SFT" sft; exit 1; }
  collect "$SFT" sft
  # packed for the next session beside PPO (bf16, ~15 parts; `hf_carry.sh fetch 0`, 4, 8, 12 once the job ended)
  SFT_ARGS=${SFT_ARGS:-} bash launch/gpu/hf_carry.sh pack "$SFT/hf" >"$RESULTS/hf_carry.log" 2>&1 &
else  # an earlier session's checkpoint (launch/gpu/hf_carry.sh, unpacked by setup.sh) or this machine's own
  echo "long_horizon: SFT checkpoint found in $SFT/hf, no SFT this time: $(tr '\n' ' ' <"$SFT/hf/CARRY.txt" 2>/dev/null)"
fi
RESUME_ARGS=()
last_checkpoint() { ls -d "$ONE_RUN"/checkpoints/step_* 2>/dev/null | tail -1; }
if [ -n "$ONE_RUN" ] && [ -f "$(last_checkpoint)/trainer_state.json" ]; then
  RESUME_ARGS=(resume=true trainer.resume_weights_only=true)  # an earlier session's checkpoint (hf_carry.sh)
  echo "long_horizon: resuming from $(last_checkpoint)"
fi
left=$((TIME_S - (SECONDS - started) - PACK_S))
echo "long_horizon: SFT done after $((SECONDS - started)) s; PPO gets $left s"
start_runs python3 -m rl.train +experiment="$EXPERIMENT" model.name="$SFT/hf" output_dir="$ROOT" \
  "${SGLANG_OVERRIDES[@]}" "${SHARED_ARGS[@]}" "${RESUME_ARGS[@]}" trainer.time_limit_s="$left" \
  trainer.time_limit_action=finish "$@"
wait_runs long_horizon collect_run
rc=$?
if [ "$PACK_S" -gt 0 ] && [ -n "$ONE_RUN" ]; then  # the final checkpoint for the next session (then `fetch`)
  last=$(last_checkpoint)
  [ -z "$last" ] || HF_CARRY_NAME=ckpt HF_CARRY_BASE="$SFT/hf" bash launch/gpu/hf_carry.sh pack "$last" "$last" \
    2>&1 | tee "$RESULTS/ckpt_carry.log"
fi
exit $rc
