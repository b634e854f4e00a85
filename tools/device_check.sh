#!/usr/bin/env bash
# One device call for the integrated tree: every GPU-marked test, megatron-core's checks, and bin/train
# parity runs (offloaded against non-offloaded, loss per iteration). Usage on the device, from the repo root:
#   bash tools/device_check.sh .whl
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:?wheel dir}
source "$(dirname "$0")/device_env.sh" "$WHL"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 bin/train --env | tee "$OUT/env.txt"

STAGES=${STAGES:-"tests parity bench megatron"}  # "te" too, after: source tools/device/te_setup.sh
stage() { [[ " $STAGES " == *" $1 "* ]]; }

stage tests && echo "== GPU tests" && timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -8

parity() {  # name, then overrides shared by both runs; the second run adds $OFF
  local name=$1; shift
  python3 bin/train "$@" logging.progress_bar=false "logging.metrics_file=$OUT/$name-base.jsonl" > "$OUT/$name-base.log" 2>&1 || { tail -3 "$OUT/$name-base.log"; return; }
  python3 bin/train "$@" $OFF logging.progress_bar=false "logging.metrics_file=$OUT/$name-off.jsonl" > "$OUT/$name-off.log" 2>&1 || { tail -3 "$OUT/$name-off.log"; return; }
  python3 - "$OUT/$name-base.jsonl" "$OUT/$name-off.jsonl" "$name" <<'PY'
import json, sys
a, b = ([r for r in map(json.loads, open(p)) if "iteration" in r] for p in sys.argv[1:3])  # not the run header
d = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
print(f"{sys.argv[3]}: {len(a)} iterations, loss {a[0]['loss']:.4f} -> {a[-1]['loss']:.4f}, max |loss delta| {d:.2e} "
      f"({'PASS' if d < 1e-3 else 'FAIL'} < 1e-3); ms/iter {sorted(x['iteration_ms'] for x in a)[len(a)//2]:.1f} -> "
      f"{sorted(x['iteration_ms'] for x in b)[len(b)//2]:.1f}; peak GiB {max(x['peak_memory_bytes'] for x in a)/2**30:.2f} -> "
      f"{max(x['peak_memory_bytes'] for x in b)/2**30:.2f}; host GiB {max(x['host_offload_bytes'] for x in b)/2**30:.2f}")
PY
}
stage parity && echo "== bin/train parity on CUDA"
SHAPE=${SHAPE:-"model.num_layers=8 model.hidden_size=512 model.num_attention_heads=8 model.seq_length=512 train.micro_batch_size=8 train.global_batch_size=16 train.train_iters=60 optimizer.lr=3e-4"}
OFF="model.cpu_offloading=true model.cpu_offloading_num_layers=6 optimizer.optimizer_cpu_offload=true optimizer.use_distributed_optimizer=true optimizer.optimizer_offload_fraction=0.5 optimizer.overlap_cpu_optimizer_d2h_h2d=true"
stage parity && parity builtin-fp32 $SHAPE train.precision=fp32
stage parity && parity builtin-bf16-half $SHAPE train.precision=bf16 train.params_dtype=half
stage parity && parity megatron-fp32 $SHAPE model.implementation=megatron train.precision=fp32
stage te && echo "== Transformer Engine: tests/test_te_gpu.py, then bin/train parity with TE layers" &&
  NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_te_gpu.py 2>&1 | tee "$OUT/te_tests.log" | tail -8
stage te && export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0  # cuDNN attention backward without atomics: runs comparable
stage te && parity te-builtin-bf16-half $SHAPE train.precision=bf16 train.params_dtype=half model.use_te=true
stage te && parity te-megatron-bf16 $SHAPE model.implementation=megatron model.use_te=true train.precision=bf16
# activation offloading alone: exact, so any delta above comes from the optimizer's rounding, amplified
stage te && OFF="model.cpu_offloading=true model.cpu_offloading_num_layers=6" parity te-builtin-act-only $SHAPE train.precision=bf16 train.params_dtype=half model.use_te=true
stage bench && echo "== bench optimizer --compare megatron (small shape)" && timeout 150 python3 bin/bench optimizer --compare megatron --layers 4 --hidden 1024 --heads 8 --seq 1024 --iters 5 --warmup 2 2>&1 | tail -12

stage megatron && echo "== megatron-core device check" && timeout 120 python3 tools/megatron_device_check.py 2>&1 | tee "$OUT/megatron_check.log" | grep -E "PASS|FAIL|SKIP|loss|Error" | tail -30
