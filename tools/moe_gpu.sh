#!/usr/bin/env bash
# One device call (estimate 5-7 min on one H200, not yet measured; the bench is stopped at 450 s and --json keeps the
# rows finished by then; the probe builds all 48 layers, 61 GB, once to plan the depth): Qwen3-30B-A3B's
# layer shape (HF Qwen3MoeForCausalLM: hidden 2048, 32 heads of 128, 4 KV heads, 128 experts of MLP 768 in every
# layer, 8 per token, vocab 151936; random init on the GPU in bf16, train.params_dtype=half, bf16, clip 1.0),
# seq 4096, micro-batch 1, 8 micro-batches per step (the seed's minimal command: global batch 8), overlap on.
# The depth is the memory plan's (bin/bench scale --layers auto): the deepest at which every row fits this
# machine, so all rows run at one depth; each row's own bound is printed (f=0 holds every fp32 state on the GPU,
# f=1 every one on the host, so the fewest of those bounds is the depth). Rows: optimizer_offload_fraction
# 0 (no optimizer offload), 0.25, 0.5, 1; 2 warm-up + 3 measured iterations each. The table puts each row's
# iteration time over f=0's beside the seed's Megatron figures for Qwen3-30B-A3B (about 1.9x at 25%, 4.2x at
# 100%; 50% interpolated on its linear scaling). TFLOP/s count the active parameters (an expert weight at 8/128).
# transformers 5 holds each layer's experts as two 3-D tensors run by grouped_mm; a version that loops over 128
# expert modules instead trains the same but each iteration takes longer (many small kernels).
# Usage, from the repo root on the device, carrying .whl (the jsonschema wheels):
#   tools/moe_gpu.sh .whl
# LAYERS=N runs every row at N layers instead (a row the plan refuses there is a row saying why).
# CPU dry run of the script itself (a tiny Qwen3-MoE from a config.json, 2 iterations a row): MOE_TINY=1 tools/moe_gpu.sh none
set -o pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_env.sh" "${1:-.whl}"
if [ -n "$MOE_TINY" ]; then
  mkdir -p "$OUT/tiny-moe"
  python3 -c 'import json, sys; from engine.bench.hf_models import SHAPES; json.dump(SHAPES["tiny-moe"], open(sys.argv[1], "w"))' \
    "$OUT/tiny-moe/config.json"
  ARGS="--hf-config $OUT/tiny-moe --device cpu --seq 64 --global-batch 2 --iters 2 --warmup 1 --data-bytes 200000"
  LIMIT=300
else
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  echo "cores $(nproc), $(free -g | awk '/Mem:/ {print $2}') GiB host memory"
  ARGS="--hf-config qwen3-30b-a3b --seq 4096 --micro-batch 1 --global-batch 8 --iters 3 --warmup 2 --lr 1e-4 --lr-warmup 5"
  LIMIT=450
fi
COMMAND="bin/bench scale $ARGS --layers ${LAYERS:-auto} --rows= --fractions 0,0.25,0.5,1 --json $OUT/moe.json"
echo "=== $COMMAND"
timeout "$LIMIT" python3 $COMMAND 2>&1 | tee "$OUT/moe.log" | grep -v '^|'
python3 - "$OUT/moe.json" "$COMMAND" <<'PY'
import json, sys
from pathlib import Path
path, command = Path(sys.argv[1]), sys.argv[2]
if not path.exists():
    sys.exit(f"no {path}: the bench did not finish; see moe.log")
result = json.loads(path.read_text())
rows, bounds = result["rows"], result.get("depth_bounds")
if result.get("partial"):
    print("\nthe bench was stopped before its last row: the rows it finished")
if bounds:
    depth = min(bounds.values())
    binding = [n for n, d in bounds.items() if d == depth]
    print(f"\nthe plan's deepest fit per row: {', '.join(f'{n}: {d}' for n, d in bounds.items())} layers; every row "
          f"runs at {depth} layers, the bound of {', '.join(binding)}")
seed = {0.0: "1.0x", 0.25: "~1.9x", 0.5: "~2.7x (interpolated)", 1.0: "~4.2x"}
base = next((r for r in rows if r["fraction"] == 0.0 and not r["unavailable"]), None)
g = lambda b: "-" if b is None else f"{b / 2**30:.1f}"
print("\n| f | CPU-stepped | layers | params | ms/iter | x f=0 | Megatron (seed) | tokens/s | TFLOP/s (active) | CPU step | GPU waited "
      "| peak GPU GiB | plan GPU GiB | host RSS GiB | plan host GiB | loss first -> last |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    f = float(r["fraction"])
    if r["unavailable"]:
        print(f"| {f:g} | - | {r['layers']} | {r['params'] / 1e9:.2f} B | not available: {r['unavailable']} |" + " |" * 11)
        continue
    x = f"{r['iter_ms'] / base['iter_ms']:.2f}x" if base else "-"
    ms = lambda v: "-" if v is None else f"{v:.0f} ms"
    share = "-" if r["cpu_params"] is None else f"{r['cpu_params'] / r['params']:.1%}"
    print(f"| {f:g} | {share} | {r['layers']} | {r['params'] / 1e9:.2f} B | {r['iter_ms']:.0f} | {x} | {seed.get(f, '-')} | "
          f"{r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {ms(r['cpu_step_ms'])} | {ms(r['gpu_wait_ms'])} | "
          f"{g(r['peak_gpu_bytes'])} | {g(r['plan_gpu_bytes'])} | {g(r['host_rss_bytes'])} | {g(r['plan_host_bytes'])} | "
          f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} |")
print(f"\ncommand: tools/moe_gpu.sh .whl  ({command}); Megatron figures: the seed's guide "
      "(Qwen3-30B-A3B, its own parallel layout and depth), ours: one H200 at the depth above")
PY
