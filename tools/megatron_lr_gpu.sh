#!/usr/bin/env bash
# Which lr schedule lets the megatron scale bench's rows report a falling loss: megatron-core's GPT with the TE
# spec (hidden 4096, LAYERS (12) layers: the 24-layer stand-in's twin, which also spiked at a constant 1e-6 or 3e-7
# without warm-up) for WARMUP + ITERS (2 + 8) steps per schedule of SCHEDULES ("lr:warm-up steps", linear warm-up
# then constant), one bench process each; the losses per schedule, the largest rise of a loss above the running
# minimum before it, and whether the last 3 steps' mean is below the first 3 steps'. Estimate on one H100: TE
# install ~20-140 s, then ~40 s a schedule.
# Usage on the device, from the repo root, carrying .whl and .te:  bash tools/megatron_lr_gpu.sh [extra bench args]
# On CPU (the local spec at a tiny shape, no TE; checks the script):  MEGATRON_LR_TINY=1 bash tools/megatron_lr_gpu.sh
set -u
SCHEDULES=${SCHEDULES:-"1e-6:4 1e-6:8 3e-7:4"}; ITERS=${ITERS:-8}; WARMUP=${WARMUP:-2}; LAYERS=${LAYERS:-12}
if [ "${MEGATRON_LR_TINY:-0}" = 1 ]; then
  OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
  shape=(--hidden 32 --heads 4 --layers-fit 1 --seq 16 --global-batch 2 --data-bytes 100000 --device cpu)
  TE=(); ITERS=2; WARMUP=1
else
  source "$(dirname "$0")/device_env.sh" .whl
  source tools/device/te_setup.sh || exit 1
  shape=(--hidden 4096 --layers-fit "$LAYERS")
  TE=(--te)
fi
for s in $SCHEDULES; do
  lr=${s%%:*}; warm=${s##*:}
  timeout 240 python3 bin/bench scale --implementation megatron "${TE[@]}" "${shape[@]}" --rows fit --iters "$ITERS" \
    --warmup "$WARMUP" --lr "$lr" --lr-warmup "$warm" --json "$OUT/megatron_lr_${lr}_$warm.json" "$@" \
    > "$OUT/megatron_lr_${lr}_$warm.log" 2>&1 || echo "schedule $s: the bench failed (its log: megatron_lr_${lr}_$warm.log)"
done
python3 - "$OUT" $SCHEDULES <<'PY'
import json, sys
out, schedules = sys.argv[1], sys.argv[2:]
for s in schedules:
    lr, warm = s.split(":")
    try:
        losses = json.load(open(f"{out}/megatron_lr_{lr}_{warm}.json"))["rows"][0]["losses"]
    except (OSError, ValueError, IndexError, KeyError) as e:
        print(f"lr {lr} warm-up {warm}: no result ({e})")
        continue
    rise = max((b - min(losses[: i + 1]) for i, b in enumerate(losses[1:])), default=0.0)
    k = min(3, len(losses) // 2)
    falls = sum(losses[-k:]) / k < sum(losses[:k]) / k
    print(f"lr {lr} warm-up {warm}: {' '.join(f'{x:.4f}' for x in losses)}  largest rise {rise:.4f}  "
          f"{'falls' if falls else 'does NOT fall'}")
PY
echo "command: SCHEDULES=\"$SCHEDULES\" ITERS=$ITERS WARMUP=$WARMUP LAYERS=$LAYERS bash tools/megatron_lr_gpu.sh $*"
