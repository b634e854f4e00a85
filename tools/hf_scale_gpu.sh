#!/usr/bin/env bash
# One device call per PART (each < 9 min on one H200): examples/hf_causal_lm.py on HF LlamaForCausalLM with
# Llama-3-8B's shape (vocab 128256, 32 layers, hidden 4096, 8 KV heads, MLP 14336; random init on the GPU in
# bf16, train.params_dtype=half, bf16, clip 1.0), micro-batch 1, 8 micro-batches per step, overlap on; the
# first micro-batch is the plan's example_batch. 2 warm-up + 4 measured iterations per row. Per row: the plan's
# choice and its GPU/host bytes against the measured peaks, s/iter, tokens/s, TFLOP/s (6N + 12*L*h*s per
# token) and its ratio to the 16-layer twin (same shape, fits without offload, same tokens per step).
#   main   seq 4096: "auto" (fraction and offloaded layers), the 16-layer twin, "auto" with the delayed update
#   grid   seq 4096, rows from GRID (default "auto 0.5:0 0.3:8 0.3:16 0.5:8 0.3:rc"; FRACTION:LAYERS offloads that
#          many layers' activations, FRACTION:rc = full recompute, no activation offload; "auto" is the plan's
#          choice measured in the same call, with the rates it measures; "auto-stated" with the stated rates):
#          a second call with e.g. GRID="0.3:24 0.5:16 0.5:24 0.5:rc" covers
#          the rest
#   long   seq 16384, 2 micro-batches per step (the same 32,768 tokens per step): "auto" with recompute_num_layers
#          "auto" too (without recompute no mix fits the host: 30 offloaded layers need 158.7 GiB), and its
#          16-layer twin at "auto"
# Usage, from the repo root on the device, carrying .whl (the jsonschema wheels):
#   tools/hf_scale_gpu.sh .whl main|grid|long
# CPU dry run of the script itself (a tiny Llama, 2 iterations a row): HF_SCALE_TINY=1 tools/hf_scale_gpu.sh none main
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}; PART=${2:-main}
source "$(dirname "$0")/device_env.sh" "$WHL"
if [ -n "$HF_SCALE_TINY" ]; then
  COMMON="--preset tiny --device cpu --steps 2 --warmup 1 --micro-batch 1 --accum 2"; TWIN=2; SEQ=64; LONG=128
  LIMIT=120
else
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  echo "cores $(nproc), $(free -g | awk '/Mem:/ {print $2}') GiB host memory"
  COMMON="--preset llama3-8b --steps 6 --warmup 2 --micro-batch 1 --accum 8"; TWIN=16; SEQ=4096; LONG=16384
  LIMIT=170
fi
COMMON="$COMMON --precision bf16 --params-dtype half --clip 1.0"
row() {  # name, seq, then the example's arguments
  local name=$1 seq=$2; shift 2
  echo "=== $name: --seq $seq $*"
  timeout "$LIMIT" python3 examples/hf_causal_lm.py $COMMON --seq "$seq" "$@" 2>&1 | tee "$OUT/$name.log" \
    | grep -v '^step [2-9]/' | tail -8
}
AUTO="--optimizer-fraction auto --activation-layers auto"
case "$PART" in
  main) ROWS="twin auto dpu"
    row twin "$SEQ" --layers "$TWIN"
    row auto "$SEQ" $AUTO
    row dpu "$SEQ" $AUTO --delayed ;;
  grid) ROWS=""  # about 1.6 minutes a row
    for cell in ${GRID:-auto 0.5:0 0.3:8 0.3:16 0.5:8 0.3:rc}; do
      f=${cell%%:*}; k=${cell##*:}; name="f${f}k$k"; [[ "$cell" == auto* ]] && name=$cell; ROWS="$ROWS $name"
      if [ "$cell" = auto ]; then row auto "$SEQ" $AUTO
      elif [ "$cell" = auto-stated ]; then row "$name" "$SEQ" $AUTO --override plan.measure_rates=false
      elif [ "$k" = rc ]; then row "$name" "$SEQ" --optimizer-fraction "$f" --recompute
      else row "$name" "$SEQ" --optimizer-fraction "$f" --activation-layers "$k"; fi
    done ;;
  long) ROWS=${LONG_ROWS:-twin16k auto16k}  # LONG_ROWS=auto16k: the model alone
    [[ " $ROWS " == *" twin16k "* ]] && row twin16k "$LONG" --accum 2 --layers "$TWIN" $AUTO
    [[ " $ROWS " == *" auto16k "* ]] && row auto16k "$LONG" --accum 2 $AUTO --recompute \
      --override model.recompute_num_layers=auto ;;
  *) echo "PART: main, grid or long"; exit 2 ;;
esac
python3 - "$OUT" "$PART" $ROWS <<'PY'
import json, sys
from pathlib import Path
out, part, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
rows = {}
for n in names:
    log = out / f"{n}.log"
    lines = [l for l in log.read_text().splitlines() if l.startswith("RESULT ")] if log.exists() else []
    rows[n] = json.loads(lines[-1][7:]) if lines else None
twin = next((r for n, r in rows.items() if n.startswith("twin") and r), None)
g = lambda b: "-" if b is None else f"{b / 2**30:.1f}"
print("\n| run | layers | params | f | offloaded layers | auto | s/iter | predicted s/iter | tokens/s | TFLOP/s | vs twin | plan GPU GiB "
      "| peak GPU GiB | plan/peak GPU | plan host GiB | peak host RSS GiB | plan/peak host |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
pred = lambda r: "-" if r.get("predicted_s_per_iter") is None else f"{r['predicted_s_per_iter']:.2f}"
for n, r in rows.items():
    if r is None:
        print(f"| {n} | failed: see {n}.log |" + " |" * 15)
        continue
    vs = f"{r['tflops'] / twin['tflops']:.0%}" if twin else "-"
    pg = f"{r['plan_gpu_bytes'] / r['peak_gpu_bytes']:.2f}" if r["peak_gpu_bytes"] else "-"
    print(f"| {n} | {r['layers']} | {r['parameters'] / 1e9:.2f} B | {float(r['optimizer_fraction']):.2f} | "
          f"{r['activation_layers']} | {','.join(k.split('.')[1] for k in r['auto']) or '-'} | {r['s_per_iter']:.2f} | {pred(r)} | "
          f"{r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {vs} | {g(r['plan_gpu_bytes'])} | {g(r['peak_gpu_bytes'])} "
          f"| {pg} | {g(r['plan_host_bytes'])} | {g(r['peak_host_bytes'])} | "
          f"{r['plan_host_bytes'] / r['peak_host_bytes']:.2f} |")
print(f"\ncommand: tools/hf_scale_gpu.sh .whl {part}; FLOPs per token = 6N + 12*L*h*s, "
      "N = L*(2h^2 + 2h*kv + 3h*f) + h*V; peak host = VmHWM of the process (includes initialize); predicted: the "
      "memory plan's step-time model at its stated rates (engine/planning/step_time.py)")
PY
