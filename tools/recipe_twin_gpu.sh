#!/usr/bin/env bash
# One device call: a shipped recipe (RECIPE, default configs/23b-h200-narrow-states.json) against its fitting twin
# with `bin/bench scale` at the recipe's shape: rows
#   fit    the same width at TWIN_LAYERS (16) layers, fp32 states, no offload, no recomputation (the twin)
#   exact  the recipe's depth with the recipe's own model/optimizer keys (fraction, recomputation, state dtypes)
#   dpu    the same with the delayed update (optimizer.delayed_param_update, 2 exact steps first), the recipe's
#          state forms kept; its GPU shadow of the CPU-stepped weights (2 B each) may not fit beside the recipe:
#          the row is then the plan's refusal, which names what does
# each WARMUP (2) + ITERS (6) iterations: TFLOP/s, ratio to the twin, peak GPU/host against the plan, the CPU
# step, and each row's losses (the recipe's loss falling: the exact row; the bench's AdamW has weight decay 0.1
# and beta2 0.95 where the recipe keeps the defaults). The table last; if the guard (GUARD, 570 s) stops the
# bench, the rows it finished are printed from its JSON.
# Estimate for the 23 B recipe on one H200 (~27 s/iter predicted): twin ~0.7 min, exact ~1-1.5 min of setup + 8 x
# 27 s, dpu refused by the plan in seconds: ~6 min (ITERS=3: ~4.5 min).
# DPU_LAYERS=N: one more bench, the dpu row alone at N layers (the depth the plan's refusal names; 64 for the 23 B
# recipe), its TFLOP/s from its own shape, to set against the twin above (DPU_GUARD, 240 s).
# Usage on the device, from the repo root, carrying .whl:  tools/recipe_twin_gpu.sh [.whl] [extra bench args]
# On CPU (the recipe's keys at a tiny shape; checks the script): RECIPE_TWIN_TINY=1 tools/recipe_twin_gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}; shift || true
RECIPE=${RECIPE:-configs/23b-h200-narrow-states.json}
WARMUP=${WARMUP:-2}; ITERS=${ITERS:-6}; GUARD=${GUARD:-570}
if [ "${RECIPE_TWIN_TINY:-0}" = 1 ]; then
  OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
  TINY=(--device cpu --layers 4 --layers-fit 2 --hidden 64 --heads 4 --seq 32 --global-batch 4 --data-bytes 200000
        --lr-warmup 2)
  TWIN_LAYERS=2; WARMUP=1; ITERS=2
else
  source "$(dirname "$0")/device_env.sh" "$WHL"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  TINY=()
fi
# the recipe -> bench scale's flags (shape, batch, lr) and the deep rows' overrides (every other model/optimizer
# key the recipe writes); --fraction is a placeholder the overrides replace (the plan's fraction of the deep
# shape at fp32 states, which bench scale would otherwise look for first, does not exist for such a recipe)
bench_args() {  # $1: "" (the twin and both deep rows) or N (the delayed row alone at N layers)
  python3 - "$RECIPE" "${TWIN_LAYERS:-16}" "$1" <<'PY'
import json, sys
recipe, twin, dpu_layers = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = json.load(open(recipe))
m, o, t = cfg["model"], cfg["optimizer"], cfg["train"]
print("\n".join(map(str, ["--hidden", m["hidden_size"], "--heads", m["num_attention_heads"], "--layers",
                          dpu_layers or m["num_layers"], "--layers-fit", twin, "--seq", m["seq_length"],
                          "--micro-batch", t.get("micro_batch_size", 1), "--global-batch", t["global_batch_size"],
                          "--lr", o["lr"], "--lr-warmup", o.get("lr_warmup_iters", 0), "--fraction", "0.5"])))
shape = {"num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "lr", "min_lr",
         "lr_warmup_iters", "lr_decay_iters", "lr_decay_style"}
every = {"accumulate_allreduce_grads_in_fp32"}  # the gradients' dtype: the twin's too
value = lambda v: v if isinstance(v, str) else json.dumps(v)  # noqa: E731
deep = ",".join(f"{ns}.{k}={value(v)}" for ns in ("model", "optimizer") for k, v in cfg.get(ns, {}).items()
                if k not in shape | every)
for k in sorted(every & set(o)):
    print("--set"); print(f"optimizer.{k}={value(o[k])}")
dpu = f"{deep},optimizer.delayed_param_update=true,optimizer.delayed_param_update_warmup=2"
if not dpu_layers:
    print("--variant"); print(f"exact:{deep}")
print("--variant"); print(f"dpu-{dpu_layers}:{dpu}" if dpu_layers else f"dpu:{dpu}")
PY
}
mapfile -t ARGS < <(bench_args "") && [ ${#ARGS[@]} -gt 0 ] || { echo "could not read $RECIPE"; exit 1; }
echo "== $RECIPE against its ${TWIN_LAYERS:-16}-layer twin: bin/bench scale --rows fit ${ARGS[*]}"
timeout "$GUARD" python3 bin/bench scale --rows fit "${ARGS[@]}" --warmup "$WARMUP" --iters "$ITERS" \
  --json "$OUT/recipe_twin.json" "${TINY[@]}" "$@" 2>&1 | tee "$OUT/recipe_twin.log" | grep -v "Warning"
if ! grep -q "^| fit " "$OUT/recipe_twin.log" && [ -s "$OUT/recipe_twin.json" ]; then  # stopped: rows done
  python3 - "$OUT/recipe_twin.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
print("\n(stopped before the table) | run | f | ms/iter | TFLOP/s | vs fit | peak GPU GiB | host RSS GiB | losses |")
for r in rows:
    gib = lambda b: f"{b / 2**30:.1f}" if b else "-"  # noqa: E731
    print(f"| {r['name']} | {r['fraction']} | {r['iter_ms'] or 0:.0f} | {r['tflops'] or 0:.0f} | "
          f"{r['vs_fit'] or 0:.0%} | {gib(r['peak_gpu_bytes'])} | {gib(r['host_rss_bytes'])} | "
          + " ".join(f"{x:.2f}" for x in r["losses"]) + f" | {r['unavailable'] or ''}")
PY
fi
if [ -n "${DPU_LAYERS:-}" ]; then  # the delayed update at the deepest depth whose GPU shadow fits (the plan names it)
  mapfile -t DEEP < <(bench_args "$DPU_LAYERS")
  echo "== the delayed update at $DPU_LAYERS layers: bin/bench scale --rows '' ${DEEP[*]}"
  timeout "${DPU_GUARD:-240}" python3 bin/bench scale --rows "" "${DEEP[@]}" --warmup "$WARMUP" --iters "$ITERS" \
    --json "$OUT/recipe_dpu_deepest.json" "${TINY[@]}" "$@" 2>&1 | tee "$OUT/recipe_dpu_deepest.log" | grep -v "Warning"
fi
echo "command: RECIPE=$RECIPE DPU_LAYERS=${DPU_LAYERS:-} tools/recipe_twin_gpu.sh $WHL $*"
