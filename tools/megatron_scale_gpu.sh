#!/usr/bin/env bash
# One device call: megatron-core GPT with the TE spec at scale against its fitting TE twin,
# `bin/bench scale --implementation megatron --te`, rows fit / exact / dpu, one size after another (SIZE, a
# space-separated list): 8b = hidden 4096 x 40 layers (twin 16) at f=0.3, 13b = hidden 5120 x 40 (twin 12) at
# the plan's fraction with bf16 gradient accumulation. ITERS measured iterations after WARMUP per row (default 8
# after 2, so that a row's loss has steps enough to fall; the 24-layer stand-in's three rows took 89 s on an H100).
# LR (3e-7) after a linear warm-up of LR_WARMUP (4) steps: the schedule tools/megatron_lr_gpu.sh found with the TE
# twin's loss falling over 10 steps (1e-6 spiked). TE installs from .te (~20 s with its built wheel there).
# Estimate on one H200 for SIZE="8b 13b": ~5-6 minutes (guard: 270 s a size).
# Usage on the device, from the repo root, carrying .whl and .te:
#   SIZE="8b 13b" bash tools/megatron_scale_gpu.sh [extra bin/bench scale args]
# On CPU (the local spec at a tiny shape, no TE; checks the script): MEGATRON_SCALE_TINY=1 bash tools/megatron_scale_gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1
ITERS=${ITERS:-8}; WARMUP=${WARMUP:-2}; GUARD=${GUARD:-270}; LR=${LR:-3e-7}; LR_WARMUP=${LR_WARMUP:-4}
if [ "${MEGATRON_SCALE_TINY:-0}" = 1 ]; then
  OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
  SIZE=tiny; TE=(); ITERS=2; WARMUP=1
else
  source "$(dirname "$0")/device_env.sh" .whl
  source tools/device/te_setup.sh || exit 1
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  TE=(--te)
fi
for size in ${SIZE:-8b}; do
  case $size in
    8b) SHAPE=(--hidden 4096 --layers 40 --layers-fit 16) ;;
    # 12.6 B does not fit at f=0.3: the plan's fraction, bf16 gradient accumulation (as the built-in 13 B rows)
    13b) SHAPE=(--hidden 5120 --layers 40 --layers-fit 12 --fraction auto
                --set optimizer.accumulate_allreduce_grads_in_fp32=false) ;;
    tiny) SHAPE=(--hidden 32 --heads 4 --layers 2 --layers-fit 1 --seq 16 --global-batch 2 --data-bytes 100000
                 --device cpu --fraction auto --set optimizer.accumulate_allreduce_grads_in_fp32=false) ;;
    *) echo "SIZE=$size: expected 8b or 13b"; exit 2 ;;
  esac
  echo "== megatron-core GPT ${TE[*]:+(TE spec) }$size"
  start=$SECONDS
  timeout "$GUARD" python3 bin/bench scale --implementation megatron "${TE[@]}" "${SHAPE[@]}" --iters "$ITERS" \
    --warmup "$WARMUP" --lr "$LR" --lr-warmup "$LR_WARMUP" --json "$OUT/megatron_scale_$size.json" "$@" 2>&1 \
    | tee "$OUT/megatron_scale_$size.log" \
    | grep -v "^  \|^FLOPs\|^hidden =\|^$\|Warning"
  echo "$size: $((SECONDS - start)) s"
done
echo "command: SIZE=\"${SIZE:-8b}\" ITERS=$ITERS WARMUP=$WARMUP LR=$LR LR_WARMUP=$LR_WARMUP bash tools/megatron_scale_gpu.sh $*"
