#!/usr/bin/env bash
# One device call (< 6 minutes on one H200): does the C AdamW pass earn its place against torch's fused
# CPU AdamW? (The bar: >= 10% faster end to end, else torch's kernels replace it.)
#   1. per call, 200 M parameters (`bin/bench cpass`): the C pass against torch.optim.AdamW(fused=True) on CPU
#      tensors plus the casts the C pass saves (bf16 gradient in, bf16 weights out), in place and out of place;
#   2. end to end (`bin/bench optimizer`, the 1.2 B GPT of docs/BENCHMARKS.md, no Megatron rows): f=0.5 and
#      f=1.0 with optimizer.use_torch_optimizer_for_cpu_offload false (the C pass, speculation on) and true
#      (torch's fused CPU AdamW), unclipped on random tokens and clipped at 1.0 on stdlib bytes;
# then one table, last. Logs and JSON in $OUT.
# Usage, from the repo root on the device (carry .whl: the jsonschema wheels the engine needs there):
#   tools/cpass_vs_torch.sh [.whl]
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${1:-.whl}
source "$(dirname "$0")/device_env.sh" "$WHL"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  echo "cores: $(nproc)"; free -g | head -2
  ${CC:-cc} --version | head -1
  python3 -c "import torch; from engine.optim import fused_kernel as f; print('torch', torch.__version__); print(f.status())"
} 2>&1 | tee "$OUT/env.txt"

timeout 100 python3 bin/bench cpass --json "$OUT/cpass.json" 2>&1 | tee "$OUT/cpass.log"
bench=(python3 bin/bench optimizer --compare none --fractions 0,0.5,1 --assist-fractions ""
       --torch-cpu-fractions 0.5,1 --iters 10 --warmup 3)
timeout 150 "${bench[@]}" --clip-grad 0 --data random --json "$OUT/unclipped.json" 2>&1 | tee "$OUT/unclipped.log"
timeout 150 "${bench[@]}" --json "$OUT/clipped.json" 2>&1 | tee "$OUT/clipped.log"

python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None

print("\n| measure | C pass | torch fused AdamW | C pass gain |")
print("|---|---|---|---|")
cp = load("cpass")
if cp:
    rows = cp["rows"]
    c_threads = next((r["threads"] for r in rows if r["path"] == "c"), None)
    for where in ("in place", "out of place"):
        c = next((r for r in rows if r["path"] == "c" and r["where"] == where), None)
        for t in sorted({r["threads"] for r in rows if r["path"] == "torch"}):
            tr = next((r for r in rows if r["path"] == "torch" and r["where"] == where and r["threads"] == t
                       and "casts" in r["name"]), None)
            if c and tr:
                print(f"| per call, {where}, G params/s (C {c_threads} threads, torch {t}; torch with its casts) "
                      f"| {c['gparams_s']:.2f} | {tr['gparams_s']:.2f} | {c['gparams_s'] / tr['gparams_s'] - 1:+.0%} |")
    bare = [r for r in rows if r["path"] == "torch" and "no casts" in r["name"]]
    for r in bare:
        print(f"| per call, torch's kernel alone (fp32 grad, no casts), {r['threads']} threads | | "
              f"{r['gparams_s']:.2f} | |")
else:
    print("| per call | bin/bench cpass failed: see cpass.log | | |")
gains = []
for name, label in (("unclipped", "unclipped, random tokens"), ("clipped", "clip 1.0, stdlib bytes")):
    run = load(name)
    if not run:
        print(f"| end to end, {label} | bin/bench optimizer failed: see {name}.log | | |")
        continue
    by = {(r["kind"], r["fraction"]): r for r in run["rows"]}
    for f in (0.5, 1.0):
        c, t = by.get(("ours", f)), by.get(("ours+torch-cpu", f))
        if not (c and t):
            continue
        gain = t["iter_s"] / c["iter_s"] - 1
        gains.append(gain)
        print(f"| end to end f={f}, {label}: ms/iteration | {c['iter_s'] * 1e3:.1f} | {t['iter_s'] * 1e3:.1f} "
              f"| {gain:+.0%} |")
        if c.get("cpu_step_s") and t.get("cpu_step_s"):
            print(f"| ... CPU step, ms | {c['cpu_step_s'] * 1e3:.0f} | {t['cpu_step_s'] * 1e3:.0f} | |")
    base = by.get(("ours", 0.0))
    if base:
        print(f"| end to end f=0 (nothing on the CPU), {label}: ms/iteration | {base['iter_s'] * 1e3:.1f} | | |")
if gains:
    verdict = "keep" if min(gains) >= 0.10 else "delete (torch's kernels)" if max(gains) < 0.10 else "mixed"
    print(f"\nC pass end to end: {min(gains):+.0%} .. {max(gains):+.0%} against torch's fused CPU AdamW "
          f"(the bar: >= +10%): {verdict}")
EOF
