#!/usr/bin/env bash
# One device call (estimate 4-6 min on one H200 for llama3-8b, not yet measured; the bench is stopped at 480 s):
# bin/bench scale --hf-config NAME at seq 4096, micro-batch 1, 8 micro-batches per step (32,768 tokens), random
# init on the GPU in bf16, bf16 half weights, fp32 master + AdamW states, clip 1.0, overlap on. Rows: the twin
# (the deepest depth of the same config whose plan fits without offload, same tokens per step), exact and
# delayed at the plan's fraction ("auto"), 2 warm-up + 4 measured iterations each; ms/iter, tokens/s, TFLOP/s
# (6N + 12*L*a*s, N the active matmul weights), vs the twin, peak GPU / host RSS against the plan's bytes.
# Usage, from the repo root on the device, carrying .whl (the jsonschema wheels):
#   tools/hf_bench_gpu.sh .whl [NAME, default llama3-8b] [more bin/bench scale args, e.g. --seq 8192]
# CPU dry run of the script itself (the tiny Llama, 2 iterations a row): HF_BENCH_TINY=1 tools/hf_bench_gpu.sh none
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}; NAME=${2:-llama3-8b}
[ $# -gt 0 ] && shift; [ $# -gt 0 ] && shift
source "$(dirname "$0")/device_env.sh" "$WHL"
if [ -n "$HF_BENCH_TINY" ]; then
  ARGS="--hf-config tiny --device cpu --seq 64 --global-batch 2 --iters 2 --warmup 1 --data-bytes 200000"
  LIMIT=300; FRACTION=0.3  # the tiny model fits without offload: "auto" would pick 0, and the dpu row refuses 0
else
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  echo "cores $(nproc), $(free -g | awk '/Mem:/ {print $2}') GiB host memory"
  ARGS="--hf-config $NAME --seq 4096 --micro-batch 1 --global-batch 8 --iters 4 --warmup 2"
  LIMIT=480
fi
echo "=== bin/bench scale $ARGS --fraction ${FRACTION:-auto} $*"
timeout "$LIMIT" python3 bin/bench scale $ARGS --fraction "${FRACTION:-auto}" "$@" --json "$OUT/hf_bench.json" 2>&1 \
  | tee "$OUT/hf_bench.log"
