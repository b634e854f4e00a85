#!/usr/bin/env bash
# One device call, about 3 minutes on one H200 with a built TE extension in .te (add ~100 s when .te holds none):
# why FP8 read slower and ~2x bf16's peak GPU memory in tools/fp8_gpu.sh.
#   1. one TE TransformerLayer, bf16 vs FP8 (hybrid/delayed) with and without TE's FP8 weight cache
#      (is_first_microbatch), at hidden 2048, 4096, 5120 (micro-batch 2 x seq 2048, 8 micro-batches): saved bytes
#      per micro-batch (FP8 data, cached FP8 weights, the rest) against TE 2.20's code, peak, ms (tools/fp8_diag.py)
#   2. the 1.35 B bench's four rows, short (2 + 4 iterations), each row's engine dropped and its memory checked
#      (held/left GiB), the most one offloaded layer copies to the host per micro-batch (tools/fp8_bench.py)
# Usage, from the repo root on the device, carrying .whl and .te:   bash tools/fp8_diag_gpu.sh
#   DIAG_ARGS="--hidden 2048" / BENCH_ARGS="--rows bf16,fp8" narrow either part.
# On CPU (a check of the script, TE absent: the torch layer in bf16, FP8 rows skipped/refused):
#   FP8_DIAG_TINY=1 bash tools/fp8_diag_gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1
if [ "${FP8_DIAG_TINY:-0}" = 1 ]; then
  python3 tools/fp8_diag.py --dry-run && python3 tools/fp8_bench.py --tiny
  exit $?
fi
source "$(dirname "$0")/device_env.sh" .whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
source tools/device/te_setup.sh || exit 1
echo "== 1. one TE layer: bf16 vs FP8, TE's FP8 weight cache off/on"
timeout 120 python3 tools/fp8_diag.py ${DIAG_ARGS:-} 2>&1 | tee "$OUT/fp8_diag.log" | grep -v "Warning\|warnings.warn"
echo "== 2. the 1.35 B bench, short; each row's engine dropped before the next"
timeout 200 python3 tools/fp8_bench.py --iters 4 --warmup 2 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/fp8_bench.log" \
  | grep -v "^\[\|Warning\|warnings.warn"
echo "command: bash tools/fp8_diag_gpu.sh (carry .whl .te)"
