#!/usr/bin/env bash
# bin/bench peers on the device, one call per model: `bash tools/peers_gpu.sh 1.2b` (built-in GPT 24 x 2048, seq
# 2048, micro-batch 4, fractions 0.25/0.5/1) or `bash tools/peers_gpu.sh 8b` (40 x 4096, FRACTIONS_8B, default 0.5;
# a peer that does not fit is a row with its error). Carry .whl (jsonschema, megatron-core) and .whl-peers
# (deepspeed, torchao, hjson, pydantic and its needs). DeepSpeed's CPU Adam is built first, timed.
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
common=(--iters 4 --warmup 2 --timeout "${ROW_TIMEOUT:-150}" --json "$OUT/peers_$model.json")
if [ -n "${PEERS_TINY:-}" ]; then  # the same rows at a tiny shape, on CPU
  shape=(--layers 2 --hidden 64 --heads 4 --seq 32 --micro-batch 2 --fractions 0.5 --threads 1 --data-bytes 200000)
fi
python3 -c "import sys; from engine.cli import bench_main; \
sys.exit(bench_main(sys.argv[1:]))" peers "${shape[@]}" "${common[@]}" --peers "$peers" 2>&1 | tee "$OUT/peers_$model.txt"
echo "total $(($(date +%s) - start)) s"
