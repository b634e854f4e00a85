#!/usr/bin/env bash
# One device call (prepared, not yet run): megatron-core GPT with the TE spec at scale against its fitting TE twin,
# `bin/bench scale --implementation megatron --te`, rows fit / exact / dpu. SIZE=8b: hidden 4096 x 40 layers
# (twin 16 layers); SIZE=13b: hidden 5120 x 40 (twin 12). Each size about 5-7 minutes on one H200 (TE's build
# ~100 s unless .te holds its built wheel); run one size per call. FP8 rows are not built: the engine has no
# FP8 recipe switch yet.
# Usage on the device, from the repo root, carrying .whl and .te:  SIZE=8b bash tools/megatron_scale_gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_env.sh" .whl
source tools/device/te_setup.sh || exit 1
case ${SIZE:-8b} in
  8b) SHAPE="--hidden 4096 --layers 40 --layers-fit 16" ;;
  13b) SHAPE="--hidden 5120 --layers 40 --layers-fit 12" ;;
  *) echo "SIZE=${SIZE}: expected 8b or 13b"; exit 2 ;;
esac
timeout 520 python3 bin/bench scale --implementation megatron --te $SHAPE --json "$OUT/megatron_scale_${SIZE:-8b}.json" \
  "$@" 2>&1 | tee "$OUT/megatron_scale_${SIZE:-8b}.log"
