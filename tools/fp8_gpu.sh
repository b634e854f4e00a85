#!/usr/bin/env bash
# One device call, about 4-5 minutes on one H200 (TE's extension build ~100 s when .te holds no built wheel; the
# bench under a 280 s guard): bf16 against FP8 (train.fp8=hybrid, delayed recipe) on a 1.3 B built-in GPT with
# Transformer Engine layers (24 x 2048, seq 2048), each without and with offload (activations of 23 layers + the
# hybrid optimizer at f=0.5): s/iter, tokens/s, TFLOP/s, peak GPU GiB, losses (tools/fp8_bench.py), then the FP8
# GPU tests (tests/test_fp8.py -m gpu).
# Usage, from the repo root on the device, carrying .whl and .te:   bash tools/fp8_gpu.sh   (ARGS="--recipe ...")
# On CPU (a check of the script: tiny shape, bf16 rows, FP8 rows refused): FP8_TINY=1 bash tools/fp8_gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1
if [ "${FP8_TINY:-0}" = 1 ]; then
  python3 tools/fp8_bench.py --tiny
  exit $?
fi
source "$(dirname "$0")/device_env.sh" .whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
source tools/device/te_setup.sh || exit 1
python3 -c "import transformer_engine as t; print('TE', t.__version__)"
echo "== bf16 vs FP8, each without and with offload"
timeout 280 python3 tools/fp8_bench.py ${ARGS:-} 2>&1 | tee "$OUT/fp8_bench.log" | grep -v "^\[\|Warning"
echo "== FP8 GPU tests"
timeout 150 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/test_fp8.py 2>&1 | tail -8
echo "command: bash tools/fp8_gpu.sh (carry .whl .te)"
