#!/usr/bin/env bash
# One device call (estimate < 1 min on one H200, not yet measured): the rates the memory plan measures before
# "auto" chooses (engine/planning/rates.py), each timed: pinned PCIe copies each way (256 MiB), the engine's CPU
# AdamW pass at the engine's thread count in three state forms (fp32; bf16 moments + remainder master; fp32 with
# fp32 gradients), bf16 matmuls of hidden 4096 and 5120; then the whole measurement as initialize runs it (one
# config, a fresh process: what a run pays) and `bin/train configs/13b-h200.json --plan` on this machine (measured)
# beside --gpu-memory 139.2 (stated), their rates lines and predicted steps. A table, then the command.
# Usage, from the repo root on the device, carrying .whl (the jsonschema wheels):  tools/rates_gpu.sh .whl
# CPU dry run of the script itself (the CPU AdamW rows at a small size, a CPU matmul): RATES_TINY=1 tools/rates_gpu.sh none
set -o pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_env.sh" "${1:-.whl}"
[ -z "$RATES_TINY" ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "cores $(nproc), $(free -g | awk '/Mem:/ {print $2}') GiB host memory"
timeout 300 python3 -W ignore - <<'PY' 2>&1 | tee "$OUT/rates.log"
import os, time
import torch
from engine.config import load_config
from engine.optim.hybrid import default_cpu_threads
from engine.planning import rates
from engine.planning.memory import settings_of

tiny = bool(os.environ.get("RATES_TINY"))
cuda = torch.cuda.is_available() and not tiny
numel = (1 << 18) if tiny else rates.ADAM_PARAMS
threads = default_cpu_threads()
bf16, f32 = torch.bfloat16, torch.float32
rows = []

def timed(name, fn, unit, scale):
    t = time.perf_counter()
    value = fn()
    rows.append((name, value, unit, scale, time.perf_counter() - t))

if cuda:
    timed("PCIe copies (D2H, H2D)", lambda: rates.pcie_rates(str(torch.device("cuda", 0))), "GB/s", 1e9)
for label, form in (("fp32 states, bf16 grads", (f32, f32, bf16, bf16, False)),
                    ("bf16 m/v + remainder master", (bf16, bf16, bf16, None, True)),
                    ("fp32 states, fp32 grads", (f32, f32, f32, bf16, False))):
    timed(f"CPU AdamW, {label}, {threads} threads", lambda f=form: rates.cpu_adam_rate(threads, *f, False, numel=numel),
          "G params/s", 1e9)
device = "cuda" if cuda else "cpu"
m_rows = 256 if tiny else rates.GEMM_ROWS
for h in ((64, 128) if tiny else (4096, 5120)):
    dtype = bf16 if cuda else f32
    timed(f"matmul [{m_rows}, {h}] x [{h}, {h}] {str(dtype)[6:]} on {device}",
          lambda h=h, d=dtype: rates.matmul_rate(device, h, d, rows=m_rows), "TFLOP/s" if cuda else "GFLOP/s",
          1e12 if cuda else 1e9)
print("\n| what | rate | unit | seconds (first call) |\n|---|---|---|---|")
for name, value, unit, scale, sec in rows:
    shown = "/".join(f"{v / scale:.2f}" for v in value) if isinstance(value, tuple) else f"{value / scale:.2f}"
    print(f"| {name} | {shown} | {unit} | {sec:.3f} |")
if cuda:  # the whole measurement as a run pays it, once per process (a second call is cached)
    for c in (rates.pcie_rates, rates.cpu_adam_rate, rates.matmul_rate):
        c.cache_clear()
    cfg = load_config("configs/13b-h200.json")
    t = time.perf_counter()
    costs = rates.for_plan(cfg, settings_of(cfg), None, here=True)
    print(f"\nconfigs/13b-h200.json, all rates as initialize measures them: {time.perf_counter() - t:.2f} s\n"
          f"  {costs.describe()}")
PY
if [ -z "$RATES_TINY" ]; then
  for FLAGS in "" "--gpu-memory 139.2 --host-memory 125"; do
    echo "=== bin/train configs/13b-h200.json --plan $FLAGS"
    /usr/bin/time -f "%e s wall" timeout 120 python3 -W ignore bin/train configs/13b-h200.json --plan $FLAGS 2>&1 \
      | grep -E "rates:|predicted step|optimizer_offload_fraction|wall" | tee -a "$OUT/rates.log"
  done
fi
echo "command: tools/rates_gpu.sh ${1:-.whl}"
