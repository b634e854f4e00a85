#!/usr/bin/env bash
# One device call, about 35 s to the first step + ~10.6 s per step on one H200 (~2.5 min for 10): bin/train on
# configs/13b-h200.json for N iterations (default 10), the loss of each printed as a table; metrics in $OUT.
# The shipped recipe's loss must fall over these iterations. CPU check of the script itself (tiny shape):
#   LOSS_13B_TINY=1 tools/loss_13b.sh
# Usage, from the repo root on the device, carrying .whl (the jsonschema wheels the engine needs there):
#   tools/loss_13b.sh [WHEEL_DIR=.whl] [ITERS=10]
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}; ITERS=${2:-10}
source "$(dirname "$0")/device_env.sh" "$WHL"
CONFIG=${CONFIG:-configs/13b-h200.json}  # or another shipped recipe, e.g. configs/17b-h200-bf16-states.json
ARGS=("$CONFIG" "train.train_iters=$ITERS" "logging.metrics_file=$OUT/metrics.jsonl" logging.progress_bar=false)
if [ -n "${LOSS_13B_TINY:-}" ]; then
  ARGS+=(model.num_layers=2 model.hidden_size=64 model.num_attention_heads=2 model.seq_length=64 train.device=cpu
         train.global_batch_size=4 data.max_bytes=1048576)
fi
timeout 400 python3 bin/train "${ARGS[@]}" 2>&1 | tee "$OUT/train.log" | grep -v "^\s*$" | tail -5
python3 - "$OUT/metrics.jsonl" <<'PY'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "iteration" in r]
print("| iteration | lr | loss | grad norm | ms/iter |\n|---|---|---|---|---|")
for r in rows:
    print(f"| {r['iteration']} | {r['lr']:.3g} | {r['loss']:.4f} | {r['grad_norm']:.3g} | {r['iteration_ms']:.0f} |")
first, last = rows[0]["loss"], rows[-1]["loss"]
print(f"loss {first:.4f} -> {last:.4f} ({100 * (last - first) / first:+.1f}%): {'falls' if last < first else 'RISES'}")
PY
echo "command: CONFIG=$CONFIG tools/loss_13b.sh $WHL $ITERS"
