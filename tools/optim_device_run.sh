#!/usr/bin/env bash
# One device call: the optimizer's GPU tests, then `bin/bench optimizer` with Megatron's HDO beside ours.
# Usage (from the repo copy on the device, carry .whl): tools/optim_device_run.sh <wheel-dir> [bench args...]
# Without bench args it runs both tables of docs/BENCHMARKS.md (unclipped on random tokens, then clip 1.0
# on stdlib bytes) into $OUT/unclipped.txt and $OUT/stdlib.txt.
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:?wheel dir}; shift
source "$(dirname "$0")/device_env.sh" "$WHL"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_optim_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
quiet='Warning|warnings.warn|Evict LRU'  # megatron-core's import-time warnings
if [ $# -gt 0 ]; then
  python3 bin/bench optimizer "$@" 2>&1 | grep -vE "$quiet" | tee "$OUT/bench.log"
else
  python3 bin/bench optimizer --clip-grad 0 --iters 10 --warmup 3 --data random 2>&1 | grep -vE "$quiet" | tee "$OUT/unclipped.txt"
  python3 bin/bench optimizer --iters 10 --warmup 3 2>&1 | grep -vE "$quiet" | tee "$OUT/stdlib.txt"
fi
