#!/usr/bin/env bash
# One device call: GPU tests of the optimizer, then `bin/bench optimizer` with Megatron's HDO beside ours.
# Usage (from the repo copy on the device): tools/optim_device_run.sh <wheel-dir> [bench args...]
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:?wheel dir}; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHL"/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 240 python3 -m pytest -q -x tests/test_optim_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
python3 bin/bench optimizer "$@" 2>&1 | tee "$OUT/bench.log"
