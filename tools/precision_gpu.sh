#!/usr/bin/env bash
# One device call, about 8-9 minutes on one H200 (guards: 330 s + 230 s): narrow optimizer states
# (optimizer.use_precision_aware_optimizer with bf16 exp_avg/exp_avg_sq on the CPU-stepped part).
#  1. bin/bench scale at the 8 B shape (hidden 4096 x 40, f=0.3, exact): the 16-layer fitting twin, fp32 states,
#     and bf16 states; TFLOP/s, ratio to the twin, CPU step ms per row (table last in scale.log).
#  2. the ceiling recipe configs/17b-h200-bf16-states.json (54 x 5120, 17.0 B, the largest the plan admits on one
#     H200 + 125 GiB with bf16 CPU-side moments) for its 10 iterations: the losses printed last.
# PART=rem instead: the 8 B rows only, with one more, bf16 states + the remainder master
# (optimizer.store_param_remainders: 8 B per CPU-stepped parameter on the host instead of 12), no ceiling run
# (about 5-6 minutes: a 450 s guard). PART=rem1: the twin and the bf16 states + remainder row only (on an 80 GB
# card: the 24-layer stand-in against a 12-layer twin, with the fp32 exact row), then `bin/bench cpass` on the same host
# (fp32 and bf16 m/v + remainder at 200 M parameters, CPASS_NUMEL; CPASS=0 leaves it out; about 1.5 minutes).
# Usage, from the repo root on the device, carrying .whl (the jsonschema wheels the engine needs there):
#   tools/precision_gpu.sh [WHEEL_DIR=.whl]        PART=rem tools/precision_gpu.sh [WHEEL_DIR=.whl]
# On CPU (a check of the script at tiny shapes): PRECISION_TINY=1 tools/precision_gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}; shift || true
NARROW=optimizer.use_precision_aware_optimizer=true,optimizer.exp_avg_dtype=bf16,optimizer.exp_avg_sq_dtype=bf16
if [ "${PRECISION_TINY:-0}" = 1 ]; then
  OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
  SCALE=(--layers-fit 1 --layers 2 --hidden 32 --seq 16 --global-batch 2 --iters 2 --warmup 1 --data-bytes 100000
         --device cpu)
  CEILING=(model.num_layers=2 model.hidden_size=64 model.num_attention_heads=4 model.seq_length=32 train.device=cpu
           train.precision=fp32 train.params_dtype=fp32 train.train_iters=3 train.global_batch_size=2
           model.cpu_offloading=false model.cpu_offloading_num_layers=0 optimizer.optimizer_offload_fraction=0.5
           optimizer.lr_warmup_iters=1 data.max_bytes=100000)
else
  source "$(dirname "$0")/device_env.sh" "$WHL"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  SCALE=()
  CEILING=()
fi
if [ "${PART:-all}" = rem1 ]; then  # the twin and bf16 states + remainder only (about 3.5 minutes)
  ROWS=fit
  # an 80 GB card holds neither 8 B at f=0.3 nor its 16-layer twin: the same width at 24 layers against a 12-layer
  # twin keeps the CPU step's share of an iteration (both scale with depth), with the fp32 exact row beside it
  if [ "${PRECISION_TINY:-0}" != 1 ] && [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits \
      | head -1)" -lt 100000 ]; then
    SCALE=(--layers 24 --layers-fit 12); ROWS=fit,exact
    echo "== under 100 GB of GPU memory: the 4.84 B stand-in (hidden 4096 x 24, twin 12 layers) at f=0.3"
  fi
  echo "== f=0.3 exact: bf16 states + remainder master, and the fitting twin"
  timeout 300 python3 bin/bench scale --rows $ROWS \
    --variant "bf16-states+rem:$NARROW,optimizer.store_param_remainders=true" \
    --json "$OUT/scale_rem1.json" "${SCALE[@]}" 2>&1 | tee "$OUT/scale_rem1.log"
  echo "command: PART=rem1 tools/precision_gpu.sh $WHL"
  if [ "${CPASS:-1}" = 1 ]; then  # the C pass alone on this host: its rate, the DRAM floor, the cores' ceiling
    numel=${CPASS_NUMEL:-200000000}; [ "${PRECISION_TINY:-0}" = 1 ] && numel=100000
    echo "== bin/bench cpass: the C pass alone on this host"
    timeout 200 python3 bin/bench cpass --numel "$numel" --reps 3 --forms fp32,bf16-m/v+remainder \
      --json "$OUT/cpass_rem1.json" 2>&1 | tee "$OUT/cpass_rem1.log" | grep "^|\|^command"
  fi
  exit 0
fi
if [ "${PART:-all}" = rem ]; then
  echo "== 8 B at f=0.3 exact: fp32 states, bf16 states, bf16 states + remainder master, and the 16-layer twin"
  timeout 450 python3 bin/bench scale --rows fit,exact --variant "bf16-states:$NARROW" \
    --variant "bf16-states+rem:$NARROW,optimizer.store_param_remainders=true" --json "$OUT/scale_rem.json" \
    "${SCALE[@]}" 2>&1 | tee "$OUT/scale_rem.log"
  echo "command: PART=rem tools/precision_gpu.sh $WHL"
  exit 0
fi
echo "== 8 B at f=0.3 exact: fp32 states against bf16 states, and the 16-layer twin"
timeout 330 python3 bin/bench scale --rows fit,exact --variant "bf16-states:$NARROW" --json "$OUT/scale.json" \
  "${SCALE[@]}" 2>&1 | tee "$OUT/scale.log"
echo "== ceiling: configs/17b-h200-bf16-states.json"
timeout 230 python3 bin/train configs/17b-h200-bf16-states.json "${CEILING[@]}" \
  logging.metrics_file="$OUT/ceiling.jsonl" 2>&1 | tail -40 | tee "$OUT/ceiling.log"
python3 - "$OUT/ceiling.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
rows = [r for r in rows if "loss" in r]
print("iteration  loss     ms/iter")
for r in rows:
    print(f"{r.get('iteration', '?'):>9}  {r['loss']:.4f}  {r.get('iteration_ms', float('nan')):.0f}")
if len(rows) > 1:
    print(f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} ({'falling' if rows[-1]['loss'] < rows[0]['loss'] else 'NOT falling'})")
EOF
echo "command: tools/precision_gpu.sh $WHL"
