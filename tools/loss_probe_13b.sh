#!/usr/bin/env bash
# One device call: configs/13b-h200.json's recipe under a few overrides, a few iterations each, to tell a
# recipe's loss spike (grows with the learning rate) from a mechanism's (does not). Each row is a name and its
# overrides (separated by commas) in ROWS, one row per line; the loss of every iteration is printed per row. A row
# longer than ROW_LIMIT seconds is stopped there (its metrics keep the iterations done: a long schedule can be
# probed by its first iterations).
# CPU check of the script (tiny shape): LOSS_PROBE_TINY=1 tools/loss_probe_13b.sh none
# Usage on the device (carry .whl): ROWS="plain8 model.num_layers=8,optimizer.optimizer_cpu_offload=false,optimizer.optimizer_offload_fraction=0,optimizer.overlap_cpu_optimizer_d2h_h2d=false" \
#   tools/loss_probe_13b.sh .whl
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}
source "$(dirname "$0")/device_env.sh" "$WHL"
TINY=()
if [ -n "${LOSS_PROBE_TINY:-}" ]; then
  TINY=(model.hidden_size=64 model.num_attention_heads=2 model.seq_length=64 train.device=cpu
        train.global_batch_size=4 data.max_bytes=1048576)
fi
while read -r name overrides; do
  [ -z "$name" ] && continue
  IFS=, read -r -a extra <<< "$overrides"
  echo "=== $name: ${extra[*]}"
  timeout -k 20 "${ROW_LIMIT:-200}" python3 bin/train configs/13b-h200.json "logging.metrics_file=$OUT/$name.jsonl" \
    logging.progress_bar=false "${TINY[@]}" "${extra[@]}" > "$OUT/$name.log" 2>&1 || tail -3 "$OUT/$name.log"
  python3 - "$OUT/$name.jsonl" <<'PY'
import json, sys
try:
    rows = [r for r in map(json.loads, open(sys.argv[1])) if "iteration" in r]
except FileNotFoundError:
    rows = []
print("  loss:", " ".join(f"{r['loss']:.3f}" for r in rows), "| grad norm:", " ".join(f"{r['grad_norm']:.3g}" for r in rows),
      "| lr:", " ".join(f"{r['lr']:.2g}" for r in rows), "| f:", rows[0]["optimizer_offload_fraction"] if rows else "-")
PY
done <<< "$ROWS"
echo "command: ROWS=... tools/loss_probe_13b.sh $WHL"
