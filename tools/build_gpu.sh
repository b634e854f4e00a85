#!/usr/bin/env bash
# One device call: how long the engine takes to build a large model on the GPU and reach its first step, and
# how much host memory that needs (VmHWM from /proc/self/status), in two fresh processes:
#   big   the built-in GPT at 13 B (hidden 5120, 40 layers, 40 heads, seq 2048), bf16 half weights, through
#         engine.initialize: timings and peak host RSS after the build, after initialize, after the first step.
#         The optimizer is SGD without momentum at f=0.5 so the step fits one H200 whatever the plan says (AdamW
#         at 13 B is the demonstration's job); what is measured is construction, not the optimizer.
#   user  a user's 1.3 B GPT built on the GPU by the user, handed to engine.initialize with AdamW at f=0.25:
#         host RSS growth against the optimizer's own host bytes (a host copy of the model would add 5 GB).
# Usage on the device, from the repo root (carry .whl: the wheels of jsonschema and its needs):
#   bash tools/build_gpu.sh .whl
# Env: FRACTION (big's, default 0.5), BIG (extra overrides for big), DEVICE=cpu with small BIG/USER shapes for a
# smoke test without a GPU. Logs and a JSON line per stage go to $OUT; the table is printed last.
set -o pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_env.sh" "$1"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export DEVICE=${DEVICE:-cuda} FRACTION=${FRACTION:-0.5}
export BIG=${BIG:-"model.num_layers=40 model.hidden_size=5120 model.num_attention_heads=40 model.seq_length=2048"}
export USER_SHAPE=${USER_SHAPE:-"24 2048 16 2048"}  # layers hidden heads seq of the user's GPT

read -r -d '' CODE <<'PY'
import json, os, sys, time

t_start = time.perf_counter()
import torch

import engine
from engine import engine as engine_module


def status(key: str) -> float:
    """GiB of a /proc/self/status line (VmHWM: peak resident set, VmRSS: now)."""
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key)) / 2**20


stage, dev = sys.argv[1], os.environ["DEVICE"]
cuda = dev == "cuda"
if cuda:
    torch.zeros(1, device="cuda")  # the CUDA context is in the baseline, not in the build
row = {"stage": stage, "import_s": time.perf_counter() - t_start, "base_hwm_gib": status("VmHWM"),
       "base_rss_gib": status("VmRSS")}
common = [f"train.device={dev}", "train.micro_batch_size=1", "train.global_batch_size=1", "train.train_iters=1",
          "logging.progress_bar=false", "logging.metrics_file=null", "optimizer.optimizer_cpu_offload=true",
          "optimizer.use_distributed_optimizer=true",
          "data.max_bytes=1048576"]

if stage == "big":
    real_build = engine_module.build_model

    def timed_build(*args, **kwargs):
        t = time.perf_counter()
        model = real_build(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        row.update(build_s=time.perf_counter() - t, build_hwm_gib=status("VmHWM"),
                   params_b=sum(p.numel() for p in model.parameters()) / 1e9,
                   build_gpu_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
        return model

    engine_module.build_model = timed_build
    overrides = [*common, *os.environ["BIG"].split(), "train.precision=bf16", "train.params_dtype=half",
                 "model.recompute_granularity=full" if cuda else "model.recompute_granularity=null",
                 "optimizer.optimizer=sgd", "optimizer.sgd_momentum=0",
                 f"optimizer.optimizer_offload_fraction={os.environ['FRACTION']}"]
    t0 = time.perf_counter()
    eng, _, _ = engine.initialize(config={}, overrides=overrides)
else:
    from engine.models.gpt import GPT

    layers, hidden, heads, seq = map(int, os.environ["USER_SHAPE"].split())
    with torch.device(dev):
        model = GPT(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq, vocab_size=256)
    row["params_b"] = sum(p.numel() for p in model.parameters()) / 1e9
    row["base_rss_gib"] = status("VmRSS")  # after the user's model exists: what initialize adds is measured
    overrides = [*common, f"model.seq_length={seq}", "train.precision=bf16",
                 "optimizer.optimizer_offload_fraction=0.25"]
    t0 = time.perf_counter()
    eng, _, _ = engine.initialize(model=model, config={}, overrides=overrides)
row.update(initialize_s=time.perf_counter() - t0, init_hwm_gib=status("VmHWM"), init_rss_gib=status("VmRSS"))
t1 = time.perf_counter()
row["loss"] = eng.train_batch()
eng.synchronize()
if cuda:
    torch.cuda.synchronize()
row.update(first_step_s=time.perf_counter() - t1, to_first_step_s=time.perf_counter() - t_start,
           step_hwm_gib=status("VmHWM"), step_rss_gib=status("VmRSS"), host_bytes_gib=eng.host_bytes() / 2**30,
           peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
print(json.dumps(row))
PY

for stage in big user; do
  python3 -c "$CODE" $stage 2>&1 | grep -vE 'Warning|warnings.warn' | tee "$OUT/$stage.log"
done
python3 - "$OUT/big.log" "$OUT/user.log" <<'PY'
import json, sys
rows = {}
for path in sys.argv[1:]:
    for line in open(path):
        if line.startswith("{"):
            r = json.loads(line)
            rows[r["stage"]] = r
print("\n== tools/build_gpu.sh")
b = rows.get("big")
if b:
    print(f"big : {b['params_b']:.2f} B params; build {b['build_s']:.1f} s, initialize {b['initialize_s']:.1f} s, "
          f"first step {b['first_step_s']:.1f} s, process start to first step {b['to_first_step_s']:.1f} s (loss {b['loss']:.3f})")
    print(f"      host VmHWM GiB: baseline {b['base_hwm_gib']:.2f}, after build {b['build_hwm_gib']:.2f} "
          f"(+{b['build_hwm_gib'] - b['base_hwm_gib']:.2f}; an fp32 host copy would be {4 * b['params_b'] * 1e9 / 2**30:.0f}), "
          f"after initialize {b['init_hwm_gib']:.2f}, after the first step {b['step_hwm_gib']:.2f} "
          f"(optimizer host bytes {b['host_bytes_gib']:.2f})")
    print(f"      GPU GiB: after build {b['build_gpu_gib']:.2f}, peak {b['peak_gpu_gib']:.2f}")
else:
    print("big : no result (see big.log)")
u = rows.get("user")
if u:
    model_gib = 4 * u["params_b"] * 1e9 / 2**30
    extra = u["step_rss_gib"] - u["base_rss_gib"] - u["host_bytes_gib"]
    print(f"user: {u['params_b']:.2f} B fp32 params on the GPU ({model_gib:.1f} GiB); host RSS +{u['init_rss_gib'] - u['base_rss_gib']:.2f} GiB "
          f"in initialize, +{u['step_rss_gib'] - u['base_rss_gib']:.2f} after the first step against {u['host_bytes_gib']:.2f} of "
          f"optimizer host bytes: {extra:+.2f} GiB beyond them ({'PASS' if extra < 0.1 * model_gib else 'FAIL'}: < 10% of the model)")
else:
    print("user: no result (see user.log)")
PY
