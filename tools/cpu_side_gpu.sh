#!/usr/bin/env bash
# One device call (about 8 minutes on one H200): the hybrid optimizer's CPU side with bounded speculation.
#  1. its GPU tests: tests/test_optim_gpu.py (CUDA parity: overlap, bf16 masters through the weight ring and
#     the spares, GPU assist) and the CPU side's host-bytes tests (tests/test_cpu_side.py, tests/test_host_plan.py);
#  2. tools/cpu_side_measure.py: the 8 B shape (bin/train's built-in GPT, hidden 4096 x 40 layers, 32 heads,
#     seq 2048, vocab 256, bf16 half weights, micro-batch 1, global batch 8, f=0.3, overlap, distributed
#     optimizer, stdlib data, 8 iterations), model built once, one job per optimizer.speculation_buffer_mb:
#     0 (off), 2048 (the default: at this shape only the small units fit, a layer's spare is 2.6 GiB),
#     1048576 (unbounded: a spare for every CPU unit, as before the bound), then with optimizer.clip_grad=0
#     (unclipped steps commit their guesses; with clip 1.0 early steps are clipped, which turns speculation
#     off) 0, 2816 (one layer: the plan's 39.4 GiB, under the 40 GiB target) and 1048576. Prints one row per
#     job as it ends (ms/iter, host bytes: engine, plan, peak RSS; peak GPU memory; speculated units), then the
#     table again.
# Logs in $OUT (gpu_tests.log, measure.log, cpu_side.json, spec_*.jsonl).
# Usage, from the repo root on the device (carry .whl: the jsonschema wheels, if the device lacks jsonschema):
#   tools/cpu_side_gpu.sh [.whl] [--jobs 0 2048 1048576 ...] [more dotted overrides]
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}; shift || true
source "$(dirname "$0")/device_env.sh" "$WHL"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nproc; free -g | head -2
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_optim_gpu.py tests/test_cpu_side.py \
  tests/test_host_plan.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
left=$((585 - SECONDS))
echo "measuring with ${left} s left"
if [ $# -gt 0 ]; then jobs=("$@"); else jobs=(--jobs 0 2048 1048576 0:0 2816:0 1048576:0); fi
timeout "$left" python3 tools/cpu_side_measure.py --out "$OUT" "${jobs[@]}" 2>&1 \
  | grep -vE 'Warning|warnings.warn' | tee "$OUT/measure.log" | tail -12
