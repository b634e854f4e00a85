#!/usr/bin/env bash
# One device call, under 1 min on one H200: the GPU-stepped part's state forms (engine/optim/gpu_narrow.py).
# First the CUDA-marked tests of tests/test_gpu_states.py (the update against float64, the remainder bit-equal to
# the fp32 master, both on torch's fused AdamW), then one table: for fp32 states (GpuPart), bf16 moments, the
# remainder master, and both, over PARAMS parameters of bf16 weights (default 1e9, in 100 M tensors), the median
# step time of 5, the bytes per parameter the mechanism states (gpu_side.gpu_step_bytes: what the plan prices) and
# the GB/s that makes, the GPU bytes held against gpu_side_bytes, and the step's peak above them against its
# stated staging. CPU check of the script itself: GPU_STATES_TINY=1 tools/gpu_states_gpu.sh
# Usage, from the repo root on the device, carrying .whl:  tools/gpu_states_gpu.sh [WHEEL_DIR=.whl]
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}
source "$(dirname "$0")/device_env.sh" "$WHL"
if [ -z "${GPU_STATES_TINY:-}" ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_states.py 2>&1 | tail -3
fi
timeout 300 python3 - <<'PY' 2>&1 | tee "$OUT/gpu_states.txt"
import os, statistics, time
import torch
from engine.optim.adam_math import Hyper
from engine.optim.gpu_side import gpu_part, gpu_side_bytes, gpu_step_bytes

tiny = bool(os.environ.get("GPU_STATES_TINY"))
dev = "cpu" if tiny else "cuda"
total, each = (2_000_000, 500_000) if tiny else (int(float(os.environ.get("PARAMS", 1e9))), 100_000_000)
sync = (lambda: None) if tiny else torch.cuda.synchronize
BF, F32 = torch.bfloat16, torch.float32
forms = {"fp32": ((F32, F32), False), "bf16 m/v": ((BF, BF), False), "remainder": ((F32, F32), True),
         "bf16 m/v + remainder": ((BF, BF), True)}
print(f"| form | ms/step | B/param stated | GB/s | held GiB (stated) | step peak over held GiB (stated staging) |")
print("|---|---|---|---|---|---|")
for name, (moments, rem) in forms.items():
    sizes = [each] * (total // each)
    params = [torch.nn.Parameter(torch.randn(n, device=dev, dtype=BF)) for n in sizes]
    grads = {f"p{i}": (torch.randn(n, device=dev) * 1e-2).to(BF) for i, n in enumerate(sizes)}
    part = gpu_part([(f"p{i}", p, 0) for i, p in enumerate(params)], kind="adam", n_groups=1,
                    moment_dtypes=moments, remainders=rem)
    h = [Hyper(1e-4, 0.9, 0.95, 1e-8, 0.1, 0.0)]
    part.step(grads, h, 1.0, 0.9)  # states allocated (torch's lazily), kernels warmed
    sync()
    held = part.held_bytes()
    stated = gpu_side_bytes(sum(sizes), kind="adam", momentum=False, half_weights=True, main_grads=False,
                            moment_bytes=(moments[0].itemsize, moments[1].itemsize), remainders=rem)
    times, peak = [], 0
    for _ in range(5):
        if not tiny:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        part.step(grads, h, 1.0, 0.9)
        sync()
        times.append(time.perf_counter() - t)
        if not tiny:
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
    ms = 1000 * statistics.median(times)
    per = gpu_step_bytes(kind="adam", half_weights=True, grad_bytes=2, moment_bytes=tuple(d.itemsize for d in moments),
                         remainders=rem)
    gib = 2**30
    print(f"| {name} | {ms:.1f} | {per} | {per * sum(sizes) / (ms / 1000) / 1e9:.0f} | "
          f"{sum(held.values()) / gib:.2f} ({(stated['master_weights'] + stated['optimizer_states']) / gib:.2f}) | "
          f"{peak / gib:.2f} ({stated['optimizer_step_staging'] / gib:.2f}) |")
    del part, params, grads
    if not tiny:
        torch.cuda.empty_cache()
print(f"{sum(sizes) / 1e9:.2f} B parameters on {dev}; step peak measured on CUDA only")
PY
echo "command: tools/gpu_states_gpu.sh $WHL"
