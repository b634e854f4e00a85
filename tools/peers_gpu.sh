#!/usr/bin/env bash
# bin/bench peers on the device, one call per model: `bash tools/peers_gpu.sh 1.2b` (built-in GPT 24 x 2048, seq
# 2048, micro-batch 4, fractions 0.25/0.5/1) or `bash tools/peers_gpu.sh 8b` (40 x 4096, FRACTIONS_8B, default 0.5;
# a peer that does not fit is a row with its error). Carry .whl (jsonschema, megatron-core) and .whl-peers
# (deepspeed, torchao, hjson, pydantic and its needs). DeepSpeed's CPU Adam is built first, timed.
# ITERS (4) measured steps after WARMUP (2) per row; LR the constant lr (the bench's default otherwise); ROW_TIMEOUT
# (150 s) stops a row. Each row is its own process
# (~10-20 s of start, build and first steps on the device before its measured steps): 1.2b is 17 rows, 8b 8 rows of
# an 8 B model (DeepSpeed's rows allocate ~100 GB of host state). Estimates on one H200: 1.2b ~5-6 min, 8b ~7-9 min
# with ITERS=2 WARMUP=1 (the CPU Adam build ~1 min of each, unless an earlier call on the same warm machine built it).
# CPU dry run of the whole script (the peers installed in this Python, no wheels installed):
#   PEERS_TINY=1 bash tools/peers_gpu.sh 1.2b
set -u
if [ -n "${PEERS_TINY:-}" ]; then  # the peers this Python has (the carried wheels are the device's: cp312)
  OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
else
  source "$(dirname "$0")/device_env.sh" .whl
  SITE_PY=$PYTHONPATH
  source "$(dirname "$0")/device_env.sh" .whl-peers
  export PYTHONPATH=$PYTHONPATH:$SITE_PY
fi
export DS_SKIP_CUDA_CHECK=1 DS_BUILD_OPS=0
model=${1:-1.2b}
start=$(date +%s)
python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" >"$OUT/cpu_adam_build.log" 2>&1 \
  && echo "DeepSpeed CPU Adam built in $(($(date +%s) - start)) s" \
  || echo "DeepSpeed CPU Adam did not build: $(tail -1 "$OUT/cpu_adam_build.log")"
peers=plain,ours,ours-delayed,megatron,ds-zero2,ds-zero3-ratio,ds-zenflow,torchao,fsdp2
case $model in
  1.2b) shape=(--layers 24 --hidden 2048 --heads 16 --seq 2048 --micro-batch 4 --fractions 0.25,0.5,1) ;;
  # fsdp2 keeps fp32 weights, gradients and Adam states on the host: 128 GB for 8 B, the machine's whole memory
  8b) shape=(--layers 40 --hidden 4096 --heads 32 --seq 2048 --micro-batch 1 --fractions "${FRACTIONS_8B:-0.5}")
      peers=${PEERS_8B:-plain,ours,ours-delayed,megatron,ds-zero2,ds-zero3-ratio,ds-zenflow,torchao} ;;
  *) echo "usage: tools/peers_gpu.sh 1.2b|8b"; exit 2 ;;
esac
common=(--iters "${ITERS:-4}" --warmup "${WARMUP:-2}" ${LR:+--lr "$LR"} --timeout "${ROW_TIMEOUT:-150}" --json "$OUT/peers_$model.json")
if [ -n "${PEERS_TINY:-}" ]; then  # the same rows at a tiny shape, on CPU
  shape=(--layers 2 --hidden 64 --heads 4 --seq 32 --micro-batch 2 --fractions 0.5 --threads 1 --data-bytes 200000)
fi
# the whole bench stopped at TOTAL_TIMEOUT (570 s: inside a device call's 600); $OUT/peers_*.json keeps every
# finished row ("partial": true) and each row's line above holds its figures
peers=${PEERS:-$peers}  # PEERS=a,b: only these rows
timeout "${TOTAL_TIMEOUT:-570}" python3 -c "import sys; from engine.cli import bench_main; \
sys.exit(bench_main(sys.argv[1:]))" peers "${shape[@]}" "${common[@]}" --peers "$peers" 2>&1 | tee "$OUT/peers_$model.txt"
echo "total $(($(date +%s) - start)) s"
