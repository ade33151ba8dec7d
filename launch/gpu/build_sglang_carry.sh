#!/bin/bash
# Build, on a CPU machine with PyPI access, SGLang 0.5.17 for our GPU machine's image (Python 3.12, torch
# 2.11.0+cu130, no network there) into .carry/sglang/ (git-ignored): a pruned, pre-installed site tree of the
# pinned wheels, xz-compressed and split into parts under 31 MiB, plus NPARTS. The parts travel in consecutive
# device calls (at most 64 MiB each); launch/gpu/setup.sh unpacks the tree once all have arrived and puts it on
# the SGLang server processes' PYTHONPATH only (its transformers pin, 5.12.1, differs from the trainer's).
# Takes ~3 min. Re-runnable from scratch. Environment: WORK (build folder), PY (a python3 with pip >= 23).
set -euo pipefail
REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
OUT=$REPO/.carry/sglang; WORK=${WORK:-/tmp/rl-sglang-build}; PY=${PY:-python3}
grep -qx '/.carry/' "$REPO/.git/info/exclude" 2>/dev/null || echo '/.carry/' >> "$REPO/.git/info/exclude"
PKGS="transformers==5.12.1 tokenizers==0.22.2 sglang==0.5.17 sglang_kernel==0.4.5 sgl_deep_gemm==0.1.5.post1
flashinfer_python==0.6.15.post1 apache_tvm_ffi==0.1.11 annotated_types==0.8.0 pydantic==2.14.4 pydantic_core==2.50.5
pydantic_extra_types==2.11.1 typing_inspection==0.4.5 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
python_multipart==0.0.34 watchfiles==1.3.0 orjson==3.13.0 msgspec==0.23.0 pybase64==1.5.1 pyzmq==27.3.0
setproctitle==1.3.8 partial_json_parser==0.2.1.1.post7 distro==1.9.0 sniffio==1.3.1 jiter==0.19.0 openai==2.6.1
compressed_tensors==0.20.1 dill==0.4.1 gguf==0.19.0 ipython==9.18.1 traitlets==5.16.1 jsonschema==4.26.0
jsonschema_specifications==2025.9.1 referencing==0.37.0 rpds_py==2026.9.1 loguru==0.7.3 mistral_common==1.13.1
pycountry==26.2.16 opentelemetry_api==1.45.2 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12 torch_memory_saver==0.0.10
torchao==0.17.0 torchcodec==0.11.1 xgrammar==0.2.1 zstandard==0.25.0 flash_attn_4==4.0.0b36 cuda_python==13.4.4"
PLAT=""; for p in 2_34 2_31 2_28 2_27 2_26 2_24 2_17 2_5; do PLAT="$PLAT --platform manylinux_${p}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
rm -rf "$WORK" "$OUT"; mkdir -p "$WORK/whl" "$OUT"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$WORK/whl" $PKGS
$PY -m pip install -q --no-deps --no-compile --no-index --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLAT --target "$WORK/site" "$WORK"/whl/*.whl
cd "$WORK/site"
# What a text-only DSA server on Hopper never loads (each checked there: the imports succeed, the server runs):
# Blackwell kernels, FA2/3's ops, the InfLLM ops, static libraries, tokeniser data of other models, locales.
rm -rf sgl_kernel/flash_ops.abi3.so sgl_kernel/sm100 sgl_kernel/infllm_ops*.so \
       xgrammar/lib/*.a mistral_common/data/tekken_*.json pycountry/locales \
       tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt torchao/test torchao/_C_cutlass_90a.abi3.so \
       torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so test bin share
find . -name __pycache__ -prune -exec rm -rf {} +
tar --sort=name --owner=0 --group=0 -cf - . | xz -T0 -9e > "$WORK/site.tar.xz"
split -b 30M -d -a 2 "$WORK/site.tar.xz" "$OUT/site.tar.xz.part"
ls "$OUT"/site.tar.xz.part* | wc -l > "$OUT/NPARTS"
du -sh "$WORK/site" "$OUT"/*
