#!/usr/bin/env bash
# One device call, about 5-6 minutes on one H200 (a 460 s guard): `bin/bench scale` at its defaults (hidden 4096,
# seq 2048, micro-batch 1, global batch 8, bf16 half weights: the 16-layer fitting twin, then 40 layers at
# f=0.3 exact, exact again with optimizer.cpu_optimizer_pin_threads=true (pinned vs not, same call), and with
# optimizer.delayed_param_update), the table last; logs and JSON in $OUT.
# Usage, from the repo root on the device, carrying .whl (the jsonschema wheels the engine needs there):
#   tools/scale_gpu.sh [WHEEL_DIR=.whl] [extra bin/bench scale args...]
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}; shift || true
source "$(dirname "$0")/device_env.sh" "$WHL"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "cores $(nproc), $(free -g | awk '/Mem:/ {print $2}') GiB host memory"
python3 bin/train --env 2>&1 | grep -E "CPU|cores|binding" | tee "$OUT/env.txt"
timeout 460 python3 bin/bench scale --pin-threads both --json "$OUT/scale.json" "$@" 2>&1 | tee "$OUT/scale.log"
