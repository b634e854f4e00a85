#!/usr/bin/env bash
# One device call for megatron-core + Transformer Engine: installs both (megatron-core 0.19.2 and jsonschema from
# .whl, TE 2.20.2 from .te via tools/device/te_setup.sh), runs every GPU-marked test and counts the skips for a
# missing extra (must be 0), then the parity and memory-vs-fraction tables (tools/megatron_parity.py).
# Usage on the device, from the repo root, carrying .whl and .te:
#   bash tools/megatron_gpu.sh                   # STAGES="tests parity" ITERS=200 TE=both JOBS=1
# JOBS=8: the parity cells of each spec side by side (8 processes on the GPU at once: the losses and peaks are
# each run's own; ms/iter is then not a speed figure). Estimate for STAGES=parity: ~2-3 min with JOBS=8 (TE
# install ~20 s with its built wheel in .te; 16 runs of 200 iterations), ~6-8 min with JOBS=1.
# On CPU (no TE, tiny shapes, 4 iterations; checks the script): MEGATRON_GPU_TINY=1 bash tools/megatron_gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1
if [ "${MEGATRON_GPU_TINY:-0}" = 1 ]; then  # before the wheels: the device's cp312 wheels do not install here
  OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
  python3 tools/megatron_parity.py --tiny --iters 4 --jobs "${JOBS:-1}" --out "$OUT/parity" | tee "$OUT/parity.md"
  exit $?
fi
source "$(dirname "$0")/device_env.sh" .whl
STAGES=${STAGES:-"tests parity"}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
source tools/device/te_setup.sh || exit 1
python3 -c "import megatron.core as m, transformer_engine as t; print('megatron-core', m.__version__, '| TE', t.__version__)"
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0  # cuDNN attention backward without atomics: runs comparable step by step
if stage tests; then
  echo "== GPU tests (pytest -m gpu)"
  timeout 300 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -12
  missing=$(grep -c "SKIPPED.*Requires: \(megatron-core\|Transformer Engine\)" "$OUT/gpu_tests.log")
  echo "GPU tests skipped for a missing extra: $missing (must be 0)"
fi
if stage parity; then
  echo "== parity and memory-vs-fraction"
  timeout 420 python3 tools/megatron_parity.py --iters "${ITERS:-200}" --te "${TE:-both}" --jobs "${JOBS:-1}" \
    --out /tmp/parity \
    2>&1 | tee "$OUT/parity.md"
  tar czf "$OUT/parity_runs.tgz" -C /tmp parity
fi
