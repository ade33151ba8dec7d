#!/bin/bash
# Any job on the GPU machine across back-to-back device calls: `start` runs the shell commands in a session of
# their own (they outlive the call while the machine stays warm), `watch` follows them in later calls.
#   bash launch/gpu/detached.sh start CALL_S NAME 'commands'
#   bash launch/gpu/detached.sh watch CALL_S NAME
# The commands run from the repo root after launch/gpu/setup.sh (SGLANG_DENSE as the caller sets it), with
# $RESULTS (/tmp/rl-out/NAME/results) for what should come back and ${SGLANG_OVERRIDES[*]} for rl.train. Each
# call prints the log's new lines until the job ends or CALL_S seconds pass, then copies the log and everything
# under $RESULTS, as one tar (NAME-results.tar, in 15 MiB parts if larger), to $OUT.
set -uo pipefail
source launch/gpu/setup.sh
VERB=$1 CALL_S=$2 NAME=$3
export RESULTS=/tmp/rl-out/$NAME/results
LOG=/tmp/rl-out/$NAME/job.log PID=/tmp/rl-out/$NAME/job.pid
mkdir -p "$RESULTS"
if [ "$VERB" = start ]; then
  printf '%s\n' "$4" >/tmp/rl-out/$NAME/job.sh
  export SGLANG_OVERRIDES_LINE="${SGLANG_OVERRIDES[*]}"
  setsid bash -c "SGLANG_OVERRIDES=(\$SGLANG_OVERRIDES_LINE); source /tmp/rl-out/$NAME/job.sh; echo \"=== job exit \$?\"" \
    >"$LOG" 2>&1 </dev/null &
  echo $! >"$PID"
  echo 0 >"$LOG.shown"
fi
follow_log "$CALL_S"
follow_running && echo "detached $NAME: still running" || echo "detached $NAME: ended"
cp "$LOG" "${OUT:-/tmp}/$NAME.log"
# one file, whatever the runs wrote (a call brings back at most 8 files of 16 MiB): $NAME-results.tar[.partNN]
tar -C "$RESULTS" -cf "/tmp/rl-out/$NAME/results.tar" . 2>/dev/null
if [ "$(stat -c %s "/tmp/rl-out/$NAME/results.tar")" -le $((15 * 1024 * 1024)) ]; then
  cp "/tmp/rl-out/$NAME/results.tar" "${OUT:-/tmp}/$NAME-results.tar"
else
  split -b 15M -d -a 2 "/tmp/rl-out/$NAME/results.tar" "${OUT:-/tmp}/$NAME-results.tar.part"
fi
exit 0
