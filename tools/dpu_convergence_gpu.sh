#!/usr/bin/env bash
# One device call, about 5-6 minutes on one H200 (a 470 s guard): the 8 B shape of bin/bench scale (hidden 4096 x
# 40 layers, seq 2048, bf16 half weights, f=0.3, global batch 8, stdlib bytes) for 60 iterations exact, then 60
# with optimizer.delayed_param_update (10 exact warm-up steps, 50 delayed), in one process: both loss curves in
# $OUT/dpu_convergence_h200_8b.png, the losses in the .json beside it, the comparison printed last.
# Usage, from the repo root on the device, carrying .whl (the jsonschema wheels the engine needs there):
#   tools/dpu_convergence_gpu.sh [WHEEL_DIR=.whl] [extra tools/dpu_convergence.py args...]
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}; shift || true
source "$(dirname "$0")/device_env.sh" "$WHL"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 470 python3 tools/dpu_convergence.py --preset h200-8b --out "$OUT/dpu_convergence_h200_8b.png" "$@" 2>&1 \
  | tee "$OUT/dpu_convergence.log"
