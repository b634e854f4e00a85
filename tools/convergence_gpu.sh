#!/usr/bin/env bash
# Convergence of the narrow CPU-side optimizer states against fp32 states: the built-in GPT at 1.2 B (hidden 2048
# x 24 layers, 16 heads, seq 1024, micro-batch 4 = global batch, vocab 256, stdlib bytes, bf16 half weights,
# optimizer f=0.25 with overlap, lr 3e-4 warm-up 100 cosine, clip 1.0, seed 1234), ITERS (1000) iterations per
# combination, same data and seed, one bin/train process each; the loss curves in one figure (bin/plot) and the
# final-loss table (mean of the last 50 iterations, difference against fp32 states) printed last.
# Combinations (COMBOS, comma-separated, default fp32,bf16,bf16+rem):
#   fp32      fp32 master, exp_avg, exp_avg_sq (the reference; must come first)
#   bf16      optimizer.exp_avg_dtype=bf16, exp_avg_sq_dtype=bf16
#             (fp16 moments are refused by the config, stored unscaled: fp16 m/v diverged at 1.2 B, fp16 m with
#             bf16 v ended at a 5.41% higher loss than fp32 states; docs/BENCHMARKS.md)
#   rem       optimizer.store_param_remainders=true (the exact remainder master: bf16 weight + 16-bit remainder)
#   bf16+rem  both (the narrowest 16-bit form: 8 B per CPU-stepped parameter on the host instead of 12)
#   int8      optimizer.exp_avg_dtype=int8_blockwise, exp_avg_sq_dtype=int8_blockwise (block-wise 8-bit moments,
#             ~1 B each per parameter on both parts)    int8+rem  the same with the remainder master
# Estimate on one H200: ~2-2.5 min per combination at 1000 iterations (~120 ms/iter), so the default three in one
# call of ~7-8 min (each run stopped at RUN_TIMEOUT=170 s); the rest in a second call: COMBOS=fp32,rem,int8
# (fp32 again, as the reference of that call).
# PARALLEL=1: every combination's run at once, side by side on the GPU (each its own process, CPU threads split
# between them; the losses are what they are alone, ms/iter is then not a speed figure), each stopped at
# RUN_TIMEOUT (default 500 s there). FRACTION (0.25) and MICRO_BATCH (4, = global batch; x seq 1024 tokens per
# step) make it cheaper: FRACTION=0.05 MICRO_BATCH=2 PARALLEL=1 COMBOS=fp32,bf16,bf16+rem,int8 is 4 runs of
# ~0.05-0.13 s/iter of GPU work each (int8's GPU part the most: torch ops), sharing it, plus int8's CPU part on 3
# threads: estimate ~5-6 min for all four (the narrow states act on both parts of the split, so the fraction
# moves where they are stepped, not what they compute). Each run is compared with fp32 states at the iterations
# both reached: a run its guard stops does not cut the others short.
# Usage, from the repo root on the device, carrying .whl (the jsonschema wheels the engine needs there):
#   tools/convergence_gpu.sh [WHEEL_DIR=.whl]
# On CPU (the whole script at a tiny shape, 30 iterations): CONVERGENCE_TINY=1 tools/convergence_gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}; shift || true
COMBOS=${COMBOS:-fp32,bf16,bf16+rem}
MB=${MICRO_BATCH:-4}
SHAPE=(model.num_layers=24 model.hidden_size=2048 model.num_attention_heads=16 model.seq_length=1024
       model.vocab_size=256 "train.micro_batch_size=$MB" "train.global_batch_size=$MB" train.device=cuda)
if [ "${CONVERGENCE_TINY:-0}" = 1 ]; then
  OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
  ITERS=${ITERS:-30}; RUN_TIMEOUT=${RUN_TIMEOUT:-300}; WARMUP=3
  SHAPE=(model.num_layers=2 model.hidden_size=64 model.num_attention_heads=4 model.seq_length=32
         model.vocab_size=256 train.micro_batch_size=2 train.global_batch_size=2 train.device=cpu
         data.max_bytes=200000)
else
  source "$(dirname "$0")/device_env.sh" "$WHL"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  ITERS=${ITERS:-1000}; RUN_TIMEOUT=${RUN_TIMEOUT:-$([ "${PARALLEL:-0}" = 1 ] && echo 500 || echo 170)}; WARMUP=100
  echo "== the remainder master's GPU test (bit-equal to the fp32 master through the copy streams)"
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_remainder.py -m gpu 2>&1 | tail -3
fi
COMMON=("${SHAPE[@]}" train.precision=bf16 train.params_dtype=half train.seed=1234 "train.train_iters=$ITERS"
        data.source=stdlib optimizer.lr=3e-4 optimizer.min_lr=3e-5 "optimizer.lr_warmup_iters=$WARMUP"
        "optimizer.lr_decay_iters=$ITERS" optimizer.lr_decay_style=cosine optimizer.clip_grad=1.0
        optimizer.weight_decay=0.1 optimizer.adam_beta2=0.95 optimizer.optimizer_cpu_offload=true
        optimizer.use_distributed_optimizer=true "optimizer.optimizer_offload_fraction=${FRACTION:-0.25}"
        optimizer.overlap_cpu_optimizer_d2h_h2d=true model.cpu_offloading=false logging.progress_bar=false)
PA=optimizer.use_precision_aware_optimizer=true
files=()
combos=(${COMBOS//,/ })
if [ "${PARALLEL:-0}" = 1 ]; then  # the CPU threads split between the runs side by side
  COMMON+=("optimizer.cpu_optimizer_threads=$(( ($(nproc) - 1) / ${#combos[@]} > 0 ? ($(nproc) - 1) / ${#combos[@]} : 1 ))")
fi
for combo in "${combos[@]}"; do
  case $combo in
    fp32) extra=() ;;
    bf16) extra=($PA optimizer.exp_avg_dtype=bf16 optimizer.exp_avg_sq_dtype=bf16) ;;
    rem) extra=($PA optimizer.store_param_remainders=true) ;;
    bf16+rem) extra=($PA optimizer.exp_avg_dtype=bf16 optimizer.exp_avg_sq_dtype=bf16
                     optimizer.store_param_remainders=true) ;;
    int8) extra=($PA optimizer.exp_avg_dtype=int8_blockwise optimizer.exp_avg_sq_dtype=int8_blockwise) ;;
    int8+rem) extra=($PA optimizer.exp_avg_dtype=int8_blockwise optimizer.exp_avg_sq_dtype=int8_blockwise
                     optimizer.store_param_remainders=true) ;;
    *) echo "unknown combination $combo: use fp32, bf16, rem, bf16+rem, int8, int8+rem (fp16 moments are refused)"
       exit 2 ;;
  esac
  name=${combo//+/-}
  echo "== $combo: ${extra[*]:-fp32 states}"
  one() {
    local start=$SECONDS
    timeout "$RUN_TIMEOUT" python3 bin/train "${COMMON[@]}" "${extra[@]}" "logging.metrics_file=$OUT/$1.jsonl" \
      > "$OUT/$1.log" 2>&1
    echo "   $1: exit $?, $((SECONDS - start)) s; last line: $(tail -1 "$OUT/$1.log")"
  }
  if [ "${PARALLEL:-0}" = 1 ]; then one "$name" & else one "$name"; fi
  files+=("$OUT/$name.jsonl")
done
wait
python3 bin/plot "${files[@]}" -o "$OUT/convergence.png" \
  || echo "(no plot here: bin/plot needs matplotlib; the metrics files are in \$OUT: bin/plot ${files[*]##*/})"
PARALLEL=${PARALLEL:-0} python3 - "${files[@]}" <<'PY' | tee "$OUT/convergence.md"
import json, os, statistics, sys
from pathlib import Path
rows = {}
for path in sys.argv[1:]:
    recs = []
    if Path(path).exists():
        for line in open(path):
            r = json.loads(line) if line.strip() else {}
            if r.get("loss") is not None and "iteration" in r:
                recs.append(r)
    rows[Path(path).stem] = recs
# each run against fp32 states at the iterations both reached (a run stopped by its guard is compared where it
# stopped, and does not cut the others' comparison short)
ref = rows.get("fp32") or []
side = " (runs side by side)" if os.environ.get("PARALLEL") == "1" else ""
print(f"\n| states | iterations run | loss first -> final (mean of the last min(50, n/5) of n compared) | vs fp32 "
      f"states at the same iterations | median ms/iter{side} |")
print("|---|---|---|---|---|")
mean = lambda recs: statistics.fmean(r["loss"] for r in recs)  # noqa: E731
for name, recs in rows.items():
    if not recs:
        print(f"| {name} | 0 | (no records: see {name}.log) | - | - |")
        continue
    n = min(len(recs), len(ref)) if ref and name != "fp32" else len(recs)
    k = min(50, max(1, n // 5))
    final = mean(recs[:n][-k:])
    vs = f"{final / mean(ref[:n][-k:]) - 1:+.2%} (n={n})" if ref and name != "fp32" else "-"
    ms = [r["iteration_ms"] for r in recs if "iteration_ms" in r]
    ms_s = f"{statistics.median(ms[len(ms) // 4:]):.0f}" if ms else "-"
    print(f"| {name} | {len(recs)} | {recs[0]['loss']:.4f} -> {final:.4f} (iterations {n - k + 1}..{n}) | {vs} "
          f"| {ms_s} |")
PY
echo "command: COMBOS=$COMBOS PARALLEL=${PARALLEL:-0} FRACTION=${FRACTION:-0.25} MICRO_BATCH=$MB tools/convergence_gpu.sh $WHL"
# a device call returns at most 8 files: the metrics and logs travel as one archive (with the figure and table)
(cd "$OUT" && tar czf convergence_runs.tar.gz ./*.jsonl ./*.log && rm -f ./*.jsonl ./*.log ./.*.lock) \
  && echo "metrics and logs: \$OUT/convergence_runs.tar.gz"
