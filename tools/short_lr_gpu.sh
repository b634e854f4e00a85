#!/usr/bin/env bash
# Which constant lr a short bench row (a few Adam steps from initialisation, no warm-up) can take with its loss
# falling: the plain 1.2 B built-in GPT (bin/bench peers' default shape, no offload) for STEPS (4) steps at each lr of
# LRS, one process each; the losses per lr, then on the last line the lr whose final loss is lowest among those
# whose loss fell ("none" if none did). Estimate on one H200: ~25 s an lr.
# Usage on the device, from the repo root, carrying .whl:  bash tools/short_lr_gpu.sh
# On CPU (a tiny shape; checks the script):  SHORT_LR_TINY=1 bash tools/short_lr_gpu.sh
set -u
LRS=${LRS:-"3e-6 1e-5 3e-5"}; STEPS=${STEPS:-4}
if [ -n "${SHORT_LR_TINY:-}" ]; then
  OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
  shape=(--layers 2 --hidden 64 --heads 4 --seq 32 --micro-batch 2 --threads 1 --data-bytes 200000)
else
  source "$(dirname "$0")/device_env.sh" .whl
  shape=()
fi
for lr in $LRS; do
  python3 -c "import sys; from engine.cli import bench_main; sys.exit(bench_main(sys.argv[1:]))" peers "${shape[@]}" \
    --peers plain --fractions 1 --iters "$STEPS" --warmup 0 --lr "$lr" --json "$OUT/short_lr_$lr.json" >/dev/null 2>&1
done
python3 - "$OUT" $LRS <<'PY'
import json, sys
out, lrs = sys.argv[1], sys.argv[2:]
best = None
for lr in lrs:
    try:
        row = json.load(open(f"{out}/short_lr_{lr}.json"))["rows"][0]
    except (OSError, ValueError, IndexError, KeyError) as e:
        print(f"lr {lr}: no result ({e})")
        continue
    if "losses" not in row:
        print(f"lr {lr}: {row.get('error', 'no losses')}")
        continue
    losses = row["losses"]
    fell = losses[-1] < losses[0]
    print(f"lr {lr}: losses " + " ".join(f"{x:.4f}" for x in losses) + ("" if fell else "  (rose)"))
    if fell and (best is None or losses[-1] < best[1]):
        best = (lr, losses[-1])
print(f"chosen lr: {best[0] if best else 'none'}")
PY
