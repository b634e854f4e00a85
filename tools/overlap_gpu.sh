#!/usr/bin/env bash
# One device call per part (each under 9 minutes on one H200), `bin/bench scale` with the CPU step measured where
# it runs (arithmetic before and after the clip factor, the GPU's waits at each CPU-stepped unit from CUDA events):
#   8b   the issue's shape (hidden 4096, 16-layer twin, 40 layers at f=0.3, global batch 8): exact (clip 1.0), the
#        delayed update, and exact variants: unclipped (clip_grad=0) with the default speculation budget (2048 MiB:
#        less than one 2.8 GB layer at this width, so no guesses) and with room for 3 layers, and the plan's fraction
#   13b  hidden 5120, 16-layer twin against 40 layers (12.6 B) at the plan's fraction, global batch 32 (65,536 tokens
#        per step), bf16 gradient accumulation in every row (the 13 B model fits only so), exact and delayed
# Usage, from the repo root on the device, carrying .whl (the jsonschema wheels):
#   tools/overlap_gpu.sh [WHEEL_DIR=.whl] [PART=8b|8b-assist|8b-tune|13b] [extra bin/bench scale args...]
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}; PART=${2:-8b}; shift 2 || true
source "$(dirname "$0")/device_env.sh" "$WHL"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "cores $(nproc), $(free -g | awk '/Mem:/ {print $2}') GiB host memory now"
case $PART in
  8b)
    timeout 540 python3 bin/bench scale --iters 6 --warmup 2 --json "$OUT/scale_8b.json" \
      --variant "unclipped:optimizer.clip_grad=0" \
      --variant "unclipped+spec3:optimizer.clip_grad=0,optimizer.speculation_buffer_mb=9000" \
      --variant "auto:optimizer.optimizer_offload_fraction=auto" "$@" 2>&1 | tee "$OUT/scale_8b.log" ;;
  8b-assist)  # the exact step with the GPU assist (the GPU otherwise waits through most of the CPU step), and
              # unclipped with and without the default speculation budget
    timeout 240 python3 bin/bench scale --iters 6 --warmup 2 --rows fit,exact --json "$OUT/scale_8b_assist.json" \
      --variant "assist:optimizer.cpu_offload_gpu_assist=true" \
      --variant "unclipped+nospec:optimizer.clip_grad=0,optimizer.speculation_buffer_mb=0" \
      --variant "unclipped:optimizer.clip_grad=0" "$@" 2>&1 | tee "$OUT/scale_8b_assist.log" ;;
  8b-tune)  # the exact step with the GPU assist and fewer CPU threads (the assist's copies need host DRAM too)
    timeout 240 python3 bin/bench scale --iters 6 --warmup 2 --rows fit,exact --json "$OUT/scale_8b_tune.json" \
      --variant "assist:optimizer.cpu_offload_gpu_assist=true" \
      --variant "assist+t12:optimizer.cpu_offload_gpu_assist=true,optimizer.cpu_optimizer_threads=12" \
      --variant "assist+t8:optimizer.cpu_offload_gpu_assist=true,optimizer.cpu_optimizer_threads=8" \
      "$@" 2>&1 | tee "$OUT/scale_8b_tune.log" ;;
  13b)
    timeout 420 python3 bin/bench scale --hidden 5120 --layers-fit 16 --layers 40 --global-batch 32 --fraction auto \
      --iters 3 --warmup 2 --set optimizer.accumulate_allreduce_grads_in_fp32=false --json "$OUT/scale_13b.json" \
      "$@" 2>&1 | tee "$OUT/scale_13b.log" ;;
  *) echo "PART must be 8b, 8b-assist, 8b-tune or 13b, got $PART"; exit 2 ;;
esac
