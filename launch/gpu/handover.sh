#!/bin/bash
# Hand a folder made on the GPU machine (an SFT checkpoint: most of a long-horizon session's GPU time) over to the
# machines of later sessions, which start bare. A device call brings back at most 8 files of 16 MiB and carries at
# most 64 MiB, so the folder travels as xz-compressed 15 MiB parts, a few a call, with their checksum:
#   GPU machine, in the job:  bash launch/gpu/handover.sh pack SRC_DIR NAME   → /tmp/rl-handover/NAME/ (parts, SHA256, NPARTS)
#   GPU machine, each call:   bash launch/gpu/handover.sh fetch NAME [N]      → the next N (3) parts not yet fetched, to $OUT
#   here, after each call:    bash launch/gpu/handover.sh keep NAME FILES_AT  → .carry/handover/NAME/ (git-ignored)
#   a later GPU machine:      carry .carry/handover/NAME/{SHA256,NPARTS,partNN...} over a few calls (3 parts a call
#                             beside the working tree); `handover.sh unpack NAME DEST_PARENT` (launch/gpu/setup.sh
#                             gathers the parts) puts SRC_DIR's folder back under DEST_PARENT once all arrived.
# `unpack` checks the checksum and fails (returns 1) until every part is there. HANDOVER_DIR (/tmp/rl-handover),
# CARRY_DIR (the repo's .carry) and HANDOVER_PART (15M) are for tests (tests/launch/test_handover.py).
set -uo pipefail
ROOT=${HANDOVER_DIR:-/tmp/rl-handover}
REPO=$(cd "$(dirname "$0")/../.." && pwd)  # (the GPU machine's copy of the tree has no .git)
CARRY=${CARRY_DIR:-$REPO/.carry}
# On the GPU machine $ROOT/NAME/ holds the packed parts (pack, fetch) or the gathered ones (unpack).
case ${1:-} in
  pack)  # SRC_DIR NAME
    SRC=$2 NAME=$3 BOX=$ROOT/$3
    rm -rf "$BOX" && mkdir -p "$BOX"
    tar -C "$(dirname "$SRC")" -cf - "$(basename "$SRC")" | xz -T0 -1 | split -b "${HANDOVER_PART:-15M}" -d -a 2 - "$BOX/part"
    cat "$BOX"/part* | sha256sum | cut -d' ' -f1 >"$BOX/SHA256"
    ls "$BOX"/part* | wc -l >"$BOX/NPARTS"
    echo "handover: $NAME packed in $(cat "$BOX/NPARTS") parts ($(du -sh "$BOX" | cut -f1))" ;;
  fetch)  # NAME [N]
    NAME=$2 BOX=$ROOT/$2 N=${3:-3}
    [ -f "$BOX/NPARTS" ] || { echo "handover: $NAME is not packed (yet)"; exit 0; }
    touch "$BOX/.fetched"
    cp "$BOX/SHA256" "$BOX/NPARTS" "${OUT:-/tmp}/"
    for p in "$BOX"/part*; do
      [ "$N" -gt 0 ] || break
      grep -qx "$(basename "$p")" "$BOX/.fetched" && continue
      cp "$p" "${OUT:-/tmp}/" && basename "$p" >>"$BOX/.fetched" && N=$((N - 1))
    done
    echo "handover: $NAME: $(wc -l <"$BOX/.fetched") of $(cat "$BOX/NPARTS") parts fetched" ;;
  keep)  # NAME FILES_AT (here: the folder where a call's files landed)
    NAME=$2 KEPT=$CARRY/handover/$2
    if [ -z "${CARRY_DIR:-}" ] && [ -d "$REPO/.git" ]; then  # the repo's .carry/ never goes into git
      grep -qx '/.carry/' "$REPO/.git/info/exclude" 2>/dev/null || echo '/.carry/' >>"$REPO/.git/info/exclude"
    fi
    mkdir -p "$KEPT"
    for f in "$3"/SHA256 "$3"/NPARTS "$3"/part[0-9][0-9]; do [ -f "$f" ] && cp "$f" "$KEPT/"; done
    echo "handover: $NAME: $(ls "$KEPT" | grep -c '^part') of $(cat "$KEPT/NPARTS") parts kept" ;;
  gather)  # (setup.sh) whatever parts this call carried → $ROOT/<name>/
    for d in "$CARRY"/handover/*/; do
      [ -d "$d" ] || continue
      mkdir -p "$ROOT/$(basename "$d")" && cp -n "$d"* "$ROOT/$(basename "$d")/" 2>/dev/null
    done
    exit 0 ;;
  unpack)  # NAME DEST_PARENT
    NAME=$2 BOX=$ROOT/$2 DEST=$3
    [ -f "$BOX/NPARTS" ] && [ "$(ls "$BOX"/part* 2>/dev/null | wc -l)" -ge "$(cat "$BOX/NPARTS")" ] \
      || { echo "handover: $NAME incomplete"; exit 1; }
    [ "$(cat "$BOX"/part* | sha256sum | cut -d' ' -f1)" = "$(cat "$BOX/SHA256")" ] \
      || { echo "handover: $NAME has the wrong checksum"; exit 1; }
    mkdir -p "$DEST" && cat "$BOX"/part* | xz -d -T0 | tar -x -C "$DEST" && echo "handover: $NAME unpacked under $DEST" ;;
  *) echo "usage: handover.sh pack SRC NAME | fetch NAME [N] | keep NAME FILES_AT | gather | unpack NAME DEST"; exit 2 ;;
esac
