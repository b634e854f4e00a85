#!/usr/bin/env bash
# One device call, under 1 min on one H200: the GPU-stepped part's state forms (engine/optim/gpu_narrow.py and its
# one-pass kernel engine/optim/narrow_kernel.py). First the CUDA-marked tests of tests/test_gpu_states.py and
# tests/test_gpu_narrow_kernel.py (the update against float64, the remainder bit-equal to the fp32 master of torch's
# fused AdamW, the one-pass step bit-equal to the staged one), then the arithmetic found on the device and one table:
# for fp32 states (GpuPart) and each narrow form (bf16 moments, the remainder master, both), the staged step (widen,
# fused AdamW, round back) and the one-pass step, over PARAMS parameters of bf16 weights (default 1e9, in 100 M
# tensors): the median step time of 5, the bytes per parameter each path moves (gpu_side.gpu_step_bytes for fp32 and
# one pass, gpu_narrow.staged_step_bytes for staged) and the GB/s that makes, the GPU bytes held against
# gpu_side_bytes, and the step's peak above them against its stated staging (the one pass holds none).
# CPU check of the script itself: GPU_STATES_TINY=1 tools/gpu_states_gpu.sh (with TRITON_INTERPRET=1 and Triton on
# PYTHONPATH, the one-pass rows too, in Triton's interpreter)
# Usage, from the repo root on the device, carrying .whl:  tools/gpu_states_gpu.sh [WHEEL_DIR=.whl]
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}
[ -n "${GPU_STATES_TINY:-}" ] && WHL=/nonexistent  # on CPU: the device's cp312 wheels do not install
source "$(dirname "$0")/device_env.sh" "$WHL"
if [ -z "${GPU_STATES_TINY:-}" ] && [ "${GPU_STATES_TESTS:-1}" = 1 ]; then  # GPU_STATES_TESTS=0: the table only
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_states.py tests/test_gpu_narrow_kernel.py \
    2>&1 | tail -4
fi
timeout 300 python3 - <<'PY' 2>&1 | tee "$OUT/gpu_states.txt"
import os, statistics, time
import torch
from engine.optim import narrow_kernel
from engine.optim.adam_math import Hyper
from engine.optim.gpu_narrow import NarrowGpuPart, staged_step_bytes
from engine.optim.gpu_side import gpu_part, gpu_side_bytes, gpu_step_bytes

tiny = bool(os.environ.get("GPU_STATES_TINY"))
dev = "cpu" if tiny else "cuda"
total, each = (2_000_000, 500_000) if tiny else (int(float(os.environ.get("PARAMS", 1e9))), 100_000_000)
sync = (lambda: None) if tiny else torch.cuda.synchronize
BF, F32 = torch.bfloat16, torch.float32
math = narrow_kernel.device_math(torch.device(dev, 0) if not tiny else torch.device("cpu"))
if tiny and os.environ.get("TRITON_INTERPRET"):  # the one-pass rows in Triton's interpreter (a check, not a figure)
    math = narrow_kernel.FLOAT
triton = getattr(narrow_kernel.triton, "__version__", "none")
print(f"torch {torch.__version__}, triton {triton}: torch's fused AdamW arithmetic here: {math}")
forms = {"fp32": ((F32, F32), False), "bf16 m/v": ((BF, BF), False), "remainder": ((F32, F32), True),
         "bf16 m/v + remainder": ((BF, BF), True)}
print("| form | step | ms/step | B/param | GB/s | held GiB (stated) | step peak over held GiB (stated staging) |")
print("|---|---|---|---|---|---|---|")
h = [Hyper(1e-4, 0.9, 0.95, 1e-8, 0.1, 0.0)]
for name, (moments, rem) in forms.items():
    for path in (["fused fp32"] if name == "fp32" else ["staged", "one pass"]):
        if path == "one pass" and math is None:
            print(f"| {name} | one pass | n/a (no Triton or no matching arithmetic on {dev}) | | | | |")
            continue
        sizes = [each] * (total // each)
        params = [torch.nn.Parameter(torch.randn(n, device=dev, dtype=BF)) for n in sizes]
        grads = {f"p{i}": (torch.randn(n, device=dev) * 1e-2).to(BF) for i, n in enumerate(sizes)}
        entries = [(f"p{i}", p, 0) for i, p in enumerate(params)]
        if path == "fused fp32":
            part = gpu_part(entries, kind="adam", n_groups=1)
        else:
            part = NarrowGpuPart(entries, moment_dtypes=moments, remainders=rem, math=math if path == "one pass" else None)
        part.step(grads, h, 1.0, 0.9)  # states allocated (torch's lazily), kernels compiled and warmed
        sync()
        held = part.held_bytes()
        mb = (moments[0].itemsize, moments[1].itemsize)
        stated = gpu_side_bytes(sum(sizes), kind="adam", momentum=False, half_weights=True, main_grads=False,
                                moment_bytes=mb, remainders=rem)
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
        per = (staged_step_bytes if path == "staged" else gpu_step_bytes)(
            half_weights=True, grad_bytes=2, moment_bytes=mb, remainders=rem, **({} if path == "staged" else {"kind": "adam"}))
        gib = 2**30
        print(f"| {name} | {path} | {ms:.1f} | {per} | {per * sum(sizes) / (ms / 1000) / 1e9:.0f} | "
              f"{sum(held.values()) / gib:.2f} ({(stated['master_weights'] + stated['optimizer_states']) / gib:.2f}) | "
              f"{peak / gib:.2f} ({stated['optimizer_step_staging'] / gib:.2f}) |")
        del part, params, grads
        if not tiny:
            torch.cuda.empty_cache()
print(f"{sum(sizes) / 1e9:.2f} B parameters on {dev}; step peak measured on CUDA only; fp32's B/param is the plan's 32")
PY
echo "command: tools/gpu_states_gpu.sh $WHL"
