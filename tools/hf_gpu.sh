#!/usr/bin/env bash
# One device call (about 3 minutes on one H200, < 5): examples/hf_causal_lm.py on a 1.1 B HF Llama (TinyLlama's
# shape: 22 layers, hidden 2048, 32 heads, 4 KV heads, MLP 5632, vocab 32000), random init from its config,
# sequences of 2048, micro-batch 2, bf16 autocast over fp32 weights, in four runs: no offload, activation
# offload of 21 layers, optimizer offload f=0.5, both. Median s/iter after warm-up and peak GPU memory each,
# what offloading moved, and a table last. Logs in $OUT.
# Usage, from the repo root on the device (carry .whl: the jsonschema wheels the engine needs there):
#   tools/hf_gpu.sh [.whl] [extra examples/hf_causal_lm.py args, e.g. --steps 20]
# A CPU dry run of the script itself: ACT_LAYERS=2 tools/hf_gpu.sh none --preset tiny --device cpu --steps 3
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}; shift || true
source "$(dirname "$0")/device_env.sh" "$WHL"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nproc; free -g | head -2
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
run() {  # name, then the example's offload arguments
  local name=$1; shift
  echo "=== $name: $*"
  timeout 140 python3 examples/hf_causal_lm.py --preset llama-1.1b --seq 2048 --micro-batch 2 --steps 12 \
    --warmup 4 --precision bf16 "$@" $EXTRA 2>&1 | tee "$OUT/hf_$name.log" | grep -v '^step [2-9]/\|^step 1[0-9]/'
}
EXTRA="$*"
run none
ACT=${ACT_LAYERS:-21}  # of the 22 layers
run act21 --activation-layers "$ACT"
run opt50 --optimizer-fraction 0.5
run both --activation-layers "$ACT" --optimizer-fraction 0.5
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
rows = []
for name in ("none", "act21", "opt50", "both"):
    log = Path(sys.argv[1]) / f"hf_{name}.log"
    lines = [l for l in log.read_text().splitlines() if l.startswith("RESULT ")] if log.exists() else []
    rows.append((name, json.loads(lines[-1][7:]) if lines else None))
base = rows[0][1]
print()
for name, r in rows:
    for line in (r or {}).get("offload", []):
        print(f"{name}: {line}")
print("\n| run | activation layers | optimizer fraction | s/iter | x no offload | peak GPU GiB | saved GiB |")
print("|---|---|---|---|---|---|---|")
for name, r in rows:
    if r is None:
        print(f"| {name} | failed: see {name}.log | | | | | |")
        continue
    peak, base_peak = r["peak_gpu_bytes"], base and base["peak_gpu_bytes"]
    gib = f"{peak / 2**30:.2f}" if peak else "-"  # None: a CPU dry run
    ratio = f"{r['s_per_iter'] / base['s_per_iter']:.2f}" if base else "-"
    saved = f"{(base_peak - peak) / 2**30:.2f}" if peak and base_peak else "-"
    print(f"| {name} | {r['activation_layers']} | {r['optimizer_fraction']} | {r['s_per_iter']:.3f} | {ratio} "
          f"| {gib} | {saved} |")
PY
