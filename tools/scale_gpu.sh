#!/usr/bin/env bash
# One device call (< 8 minutes on one H200): `bin/bench scale` at its defaults (hidden 4096, seq 2048, the
# 16-layer fitting twin against 40 layers at f=0.3, exact and with the delayed parameter update), logs in $OUT.
# Usage, from the repo root on the device (carry .whl: the jsonschema wheels the engine needs there):
#   tools/scale_gpu.sh [.whl] [extra bin/bench scale args...]
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHL"/*.whl \
    >/dev/null 2>&1 || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nproc; free -g | head -2
timeout 460 python3 bin/bench scale --json "$OUT/scale.json" "$@" 2>&1 | tee "$OUT/scale.log"
