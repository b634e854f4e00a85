#!/usr/bin/env bash
# One device call (< 9 minutes on one H200): the memory plan against what bin/train really holds, for three
# models: 1.2 B (hidden 2048 x 24, f=0.25, 8 offloaded layers with double buffering, overlap), 8 B (hidden
# 4096 x 40, f=0.3, overlap) and the 13 B demonstration (configs/13b-h200.json, "auto" resolved on the device).
# Each: `bin/train ... --plan --json` (budgets: this machine's free CUDA memory and available host memory),
# then 3 training iterations of the same config. Printed last, one row per model:
#   plan GPU peak (no margin) vs torch.cuda.max_memory_allocated, plan GPU total (with margin) vs
#   torch.cuda.max_memory_reserved, plan host total vs the process's peak RSS.
# Peak RSS is VmHWM from /proc/self/status of the training process itself (engine.planning.budget.peak_rss_bytes,
# written into every metrics record as peak_host_rss_bytes): the high-water mark of its resident pages,
# pinned buffers and the CUDA driver's host mappings included, the page cache of files excluded.
# Usage, from the repo root on the device (carry .whl: the jsonschema wheels the engine needs there):
#   tools/plan_vs_measured.sh [.whl]
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}
source "$(dirname "$0")/device_env.sh" "$WHL"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
nproc; free -g | head -2

COMMON=(model.seq_length=2048 model.vocab_size=256 train.precision=bf16 train.params_dtype=half
        train.micro_batch_size=1 train.global_batch_size=8 train.device=cuda optimizer.optimizer_cpu_offload=true
        optimizer.use_distributed_optimizer=true optimizer.overlap_cpu_optimizer_d2h_h2d=true
        optimizer.lr_warmup_iters=0 train.train_iters=3 logging.progress_bar=false)
B1=("${COMMON[@]}" model.num_layers=24 model.hidden_size=2048 model.num_attention_heads=16
    optimizer.optimizer_offload_fraction=0.25 model.cpu_offloading=true model.cpu_offloading_num_layers=8
    model.cpu_offloading_double_buffering=true)
B8=("${COMMON[@]}" model.num_layers=40 model.hidden_size=4096 model.num_attention_heads=32
    optimizer.optimizer_offload_fraction=0.3)
one() {  # name, time limit (s), config file, overrides...
  local name=$1 limit=$2 config=$3; shift 3
  echo "=== $name: $(date +%T)"
  python3 bin/train "$config" "$@" --plan --json > "$OUT/$name.plan.json" 2> "$OUT/$name.plan.err"
  echo "plan rc=$? $(head -c 300 "$OUT/$name.plan.err")"
  rm -f "$OUT/$name.jsonl"
  timeout "$limit" python3 bin/train "$config" "$@" "logging.metrics_file=$OUT/$name.jsonl" \
    > "$OUT/$name.log" 2>&1
  echo "train rc=$? $(date +%T)"; tail -3 "$OUT/$name.log"
}

MODELS=${MODELS:-"1.2B 8B 13B"}  # a subset, e.g. MODELS="1.2B 13B"; ITERS_13B: the demo's iterations (3)
B13=(train.train_iters=${ITERS_13B:-3} logging.progress_bar=false)
for m in $MODELS; do
  case $m in
    1.2B) one 1.2B 100 configs/default.json "${B1[@]}" ;;
    8B) one 8B 170 configs/default.json "${B8[@]}" ;;
    13B) one 13B "${LIMIT_13B:-250}" configs/13b-h200.json "${B13[@]}" ;;
  esac
done

python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
G = 2**30
print(f"{'model':<6} {'f':>5} {'k':>3} | {'plan GPU peak':>13} {'allocated':>10} {'ratio':>6} | {'plan GPU+margin':>15} "
      f"{'reserved':>9} {'ratio':>6} | {'plan host':>9} {'VmHWM':>7} {'ratio':>6} | tokens/s", flush=True)
for name in ("1.2B", "8B", "13B"):
    try:
        plan = json.loads((out / f"{name}.plan.json").read_text())
    except (OSError, ValueError):
        err = out / f"{name}.plan.err"
        print(f"{name:<6} no plan: {err.read_text()[:200] if err.exists() else 'not run'}")
        continue
    metrics = out / f"{name}.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    rows = [r for r in rows if "peak_memory_bytes" in r]  # iteration records (each run starts with a header)
    peak = max(plan["gpu"]["phases"].values())
    total, host = plan["gpu"]["total_bytes"], plan["host"]["total_bytes"]
    if not rows:
        print(f"{name:<6} {plan['fraction']:>5.2f} {plan['offloaded_layers']:>3} | {peak/G:>11.1f} G  no iteration finished")
        continue
    alloc = max(r["peak_memory_bytes"] for r in rows)
    res = max(r.get("peak_gpu_reserved_bytes", 0) for r in rows)
    rss = max(r.get("peak_host_rss_bytes", 0) for r in rows)
    tps = sorted(r["tokens_per_s"] for r in rows)[len(rows) // 2]
    print(f"{name:<6} {plan['fraction']:>5.2f} {plan['offloaded_layers']:>3} | {peak/G:>11.1f} G {alloc/G:>8.1f} G "
          f"{alloc/peak:>6.3f} | {total/G:>13.1f} G {res/G:>7.1f} G {res/total:>6.3f} | {host/G:>7.1f} G "
          f"{rss/G:>5.1f} G {rss/host:>6.3f} | {tps:,.0f}")
    print(f"       plan GPU phases (GiB): " + ", ".join(f"{k} {v/G:.1f}" for k, v in plan["gpu"]["phases"].items())
          + f"; host phases: " + ", ".join(f"{k} {v/G:.1f}" for k, v in plan["host"]["phases"].items()))
EOF
