#!/usr/bin/env bash
# One device call: GPU offload tests, then `bin/bench activations` with the arguments given.
# Usage (from the repo root on the device): tools/offload_device.sh [tests|notests] [bench args...]
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
if [ "$1" = tests ]; then
  python3 -m pytest -q -s -p no:cacheprovider tests/test_offload_gpu.py tests/test_offload.py 2>&1 | tee "$OUT/tests.log" | grep -v '^$'
fi
shift
[ "$1" = nobench ] && exit 0
python3 bin/bench activations "$@" --json "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench.log"
