#!/bin/bash
# Keep an HF folder made on the GPU machine (the SFT cold start's checkpoint) for the next session. The machine is
# bare at every session's start, and a long-horizon SFT costs ~265 s of the session's 1,800. The weights travel in
# bf16, xz-compressed (the 135M policy: 270 MB, ~195 MB after xz), as 13-MiB parts, four a device call each way: a
# call brings at most 64 MiB back, and carries 64 MiB in with the working tree (~8 MB).
#   GPU machine, after the SFT:  bash launch/gpu/hf_carry.sh pack SRC [DEST]   (DEST: where it unpacks; SRC if none)
#   GPU machine, a call each:    bash launch/gpu/hf_carry.sh fetch FIRST        (parts FIRST..FIRST+3 → $OUT)
#   here, after each fetch:      bash launch/gpu/hf_carry.sh stage FILES_AT     (→ .carry/hf0, hf1, ...: one a call)
#   GPU machine, every call:     bash launch/gpu/hf_carry.sh unpack             (launch/gpu/setup.sh runs it)
# `unpack` gathers the parts of .carry/hf* that each call brings and, once all have arrived and the checksum holds,
# unpacks them to DEST; long_horizon.sh then finds the SFT done and starts PPO at once. The weights are the SFT's
# fp32 weights rounded to bf16 (at most 2^-8 of each weight; the trainer loads them back in fp32), and the step-0
# evaluation measures the policy PPO starts from, as always. CARRY.txt in the folder says where and when it was made.
#
# A PPO checkpoint (checkpoints/step_N: actor/hf, critic/hf, trainer_state.json) travels the same way under another
# name, HF_CARRY_NAME=ckpt (parts ckpt.tar.partNN, folders .carry/ckpt0, ckpt1, ...), without DeepSpeed's optimizer
# state (rl.train resumes from it with trainer.resume_weights_only=true), and with HF_CARRY_BASE set to the SFT's HF
# folder: each weight the base also has travels as its difference from the base, in bf16 (exact to ~2^-9 of the
# difference). Rounding the weights themselves to bf16 would undo much of a session's training: 16 steps at lr 2e-5
# move a weight by ~3e-4, about one bf16 step of a weight of 0.05. `unpack` adds the base back (it must be there
# first: setup.sh unpacks the SFT's folder before the checkpoint) and writes those tensors in fp32. The base must be
# the same on both machines: it is where the SFT came carried (bf16 on both); after a fresh SFT the packing machine
# holds it in fp32 and the next one its bf16 carry, which moves each weight once by that rounding (≤ 2^-9 of it).
set -euo pipefail
VERB=${1:-}; shift || true
NAME=${HF_CARRY_NAME:-hf}
PACKED=${HF_CARRY_PACKED:-/tmp/rl-$NAME-carry}  # pack's output on the GPU machine
PARTS=${HF_CARRY_PARTS:-/tmp/rl-$NAME-parts}    # unpack's gathering place there (it outlives a call)
PART_SIZE=${HF_CARRY_PART_SIZE:-13M} PER_CALL=4  # split -b's size; smaller only in the tests
in_order() { find "$@" -name "$NAME.tar.part*" -printf '%f %p\n' | sort | cut -d' ' -f2; }  # parts by number
checksum() { in_order "$@" | xargs cat | sha256sum | cut -d' ' -f1; }
case $VERB in
pack)
  SRC=$1 DEST=${2:-$1} BASE=${HF_CARRY_BASE:-}
  if [ -n "$BASE" ] && ! ls "$BASE"/*.safetensors >/dev/null 2>&1; then
    echo "hf_carry: HF_CARRY_BASE=$BASE holds no safetensors: no base to take differences from" >&2; exit 1
  fi
  rm -rf "$PACKED" && mkdir -p "$PACKED/hf"
  python3 - "$SRC" "$PACKED/hf" "$BASE" <<'PY'
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
base = {}  # the base's tensors by name: a weight of the same name and shape travels as its difference from it
for f in sorted(Path(sys.argv[3]).glob("*.safetensors")) if sys.argv[3] else []:
    base.update(load_file(f))
for f in sorted(src.rglob("*")):
    if not f.is_file() or "state" in f.relative_to(src).parts[:-1]:  # DeepSpeed's optimizer state stays here
        continue
    out = dst / f.relative_to(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    if f.suffix != ".safetensors":
        shutil.copy2(f, out)
        continue
    tensors, delta = load_file(f), []
    for k, v in tensors.items():
        if v.is_floating_point():
            if k in base and base[k].shape == v.shape:
                v = v.float() - base[k].float()
                delta.append(k)
            tensors[k] = v.to(torch.bfloat16).contiguous()
    save_file(tensors, out, metadata={"format": "pt", "carry_delta": json.dumps(delta)})
PY
  { echo "made $(date -u +%FT%TZ) from $SRC, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    if [ -n "$BASE" ]; then echo "weights as their difference from $BASE, in bf16 (unpacked in fp32)"
    else echo "weights rounded to bf16 for the carry (the trainer loads them in fp32)"; fi
    [ -z "${SFT_ARGS:-}" ] || echo "SFT_ARGS: $SFT_ARGS"; } > "$PACKED/hf/CARRY.txt"
  # xz -1: the exponents compress: to 63% for the base policy (dequantised from 4 bits), to ~72% with ~1% noise
  # added to every weight as an SFT would (simulated on the CPU: an SFT checkpoint never left the GPU machine yet)
  tar -C "$PACKED/hf" -cf - . | nice -n 10 xz -T0 -1 | split -b "$PART_SIZE" -d -a 2 - "$PACKED/$NAME.tar.part"
  rm -rf "$PACKED/hf"
  checksum "$PACKED" > "$PACKED/SHA256"
  echo "$DEST" > "$PACKED/DEST"
  echo "$BASE" > "$PACKED/BASE"
  n=$(in_order "$PACKED" | wc -l); echo "$n" > "$PACKED/NPARTS"
  echo "hf_carry: packed $SRC in $n parts: fetch $(seq -s ', ' 0 $PER_CALL $((n - 1))), a call each"
  ;;
fetch)
  FIRST=$1
  [ -f "$PACKED/NPARTS" ] || { echo "hf_carry: nothing packed in $PACKED (yet?)" >&2; exit 1; }
  cp "$PACKED/SHA256" "$PACKED/DEST" "$PACKED/NPARTS" "$PACKED/BASE" "${OUT:?}/"
  for i in $(seq "$FIRST" $((FIRST + PER_CALL - 1))); do
    f=$(printf '%s/%s.tar.part%02d' "$PACKED" "$NAME" "$i"); [ ! -f "$f" ] || cp "$f" "$OUT/"
  done
  n=$(cat "$PACKED/NPARTS") last=$((FIRST + PER_CALL - 1)); [ "$last" -lt "$n" ] || last=$((n - 1))
  echo "hf_carry: parts $FIRST-$last of $n (numbered from 0) in \$OUT"
  ;;
stage)
  FROM=$1 REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
  CARRY=${HF_CARRY_DIR:-$REPO/.carry}
  # a fetch that brought nothing (pack not done, machine gone) must not clear the parts staged so far
  [ -f "$FROM/SHA256" ] && [ -f "$FROM/NPARTS" ] && [ -f "$FROM/DEST" ] \
    || { echo "hf_carry: no packed parts in $FROM (did the fetch say \"nothing packed\"?)" >&2; exit 1; }
  [ -n "${HF_CARRY_DIR:-}" ] || grep -qx '/.carry/' "$REPO/.git/info/exclude" 2>/dev/null \
    || echo '/.carry/' >> "$REPO/.git/info/exclude"
  if [ -f "$CARRY/${NAME}0/SHA256" ] && ! cmp -s "$FROM/SHA256" "$CARRY/${NAME}0/SHA256"; then  # another's parts
    rm -rf "$CARRY/$NAME"[0-9]*
  fi
  mkdir -p "$CARRY/${NAME}0" && cp "$FROM/SHA256" "$FROM/DEST" "$FROM/NPARTS" "$CARRY/${NAME}0/"
  [ ! -f "$FROM/BASE" ] || cp "$FROM/BASE" "$CARRY/${NAME}0/"  # packed before BASE existed: no base
  for f in $(in_order "$FROM"); do
    i=$((10#${f##*part})); mkdir -p "$CARRY/$NAME$((i / PER_CALL))"; cp "$f" "$CARRY/$NAME$((i / PER_CALL))/"
  done
  chmod -R u+w "$CARRY/$NAME"[0-9]*  # the device tool hands its files over read-only; a later stage overwrites them
  have=$(in_order "$CARRY/$NAME"[0-9]* | wc -l) n=$(cat "$CARRY/${NAME}0/NPARTS")
  if [ "$have" -lt "$n" ]; then echo "hf_carry: $have of $n parts staged"; exit 0; fi
  if [ "$(checksum "$CARRY/$NAME"[0-9]*)" != "$(cat "$CARRY/${NAME}0/SHA256")" ]; then
    echo "hf_carry: all $n parts staged, but the checksum does not hold: fetch them again" >&2; exit 1
  fi
  echo "hf_carry: all $n parts staged in $(cd "$CARRY" && ls -d "$NAME"[0-9]* | tr '\n' ' ')(carry one a call);" \
       "they unpack to $(cat "$CARRY/${NAME}0/DEST")"
  ;;
unpack)
  CARRY=${HF_CARRY_DIR:-.carry}
  mkdir -p "$PARTS"
  for f in "$CARRY/$NAME"[0-9]*/*; do  # a warm machine still has the earlier calls' folders
    [ ! -f "$f" ] || [ -e "$PARTS/${f##*/}" ] || cp "$f" "$PARTS/"
  done
  [ -f "$PARTS/NPARTS" ] || exit 0  # nothing carried
  BASE=$(cat "$PARTS/BASE" 2>/dev/null || true)
  if [ ! -f "$PARTS/.unpacked" ] && [ "$(in_order "$PARTS" | wc -l)" -ge "$(cat "$PARTS/NPARTS")" ]; then
    if [ "$(checksum "$PARTS")" != "$(cat "$PARTS/SHA256")" ]; then
      echo "hf_carry: the carried $NAME folder's checksum does not hold" >&2; exit 1
    fi
    if [ -n "$BASE" ] && [ ! -f "$BASE/config.json" ]; then  # a later call, once the base has arrived
      echo "hf_carry: $NAME: all parts here; waiting for its base $BASE"; exit 0
    fi
    DEST=$(cat "$PARTS/DEST"); rm -rf "$DEST.partial" && mkdir -p "$DEST.partial"
    # into DEST.partial first: a half-unpacked DEST with its config.json would pass for a finished SFT
    in_order "$PARTS" | xargs cat | xz -d -T0 | tar -x -C "$DEST.partial" \
      || { echo "hf_carry: unpacking to $DEST failed" >&2; rm -rf "$DEST.partial"; exit 1; }
    # differences back to weights (only a pack with a base made them; the SFT's own carry skips this)
    [ -z "$BASE" ] || python3 - "$DEST.partial" "$BASE" <<'PY' \
      || { echo "hf_carry: adding the base failed" >&2; rm -rf "$DEST.partial"; exit 1; }
import json, sys
from pathlib import Path
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
base = {}
for f in sorted(Path(sys.argv[2]).glob("*.safetensors")):
    base.update(load_file(f))
for f in sorted(Path(sys.argv[1]).rglob("*.safetensors")):
    with safe_open(f, "pt") as opened:
        delta = json.loads((opened.metadata() or {}).get("carry_delta", "[]"))
    if delta:
        tensors = load_file(f)
        for k in delta:
            tensors[k] = (base[k].float() + tensors[k].float()).contiguous()
        save_file(tensors, f, metadata={"format": "pt"})
PY
    rm -rf "$DEST" && mv "$DEST.partial" "$DEST" && touch "$PARTS/.unpacked"
  fi
  if [ -f "$PARTS/.unpacked" ]; then echo "hf_carry: $NAME folder ready in $(cat "$PARTS/DEST")"
  else echo "hf_carry: $NAME folder parts: $(in_order "$PARTS" | wc -l) of $(cat "$PARTS/NPARTS")"; fi
  ;;
*) echo "usage: [HF_CARRY_NAME=ckpt HF_CARRY_BASE=DIR] hf_carry.sh pack SRC [DEST] | fetch FIRST | stage DIR | unpack" >&2
   exit 2 ;;
esac
