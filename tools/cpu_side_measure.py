"""Host memory and iteration time of the hybrid optimizer's CPU side at several `speculation_buffer_mb` bounds.

Each bound is one `bin/train` job (engine.cli.train on the config bin/train would build from the same overrides)
in this one process; the model is built and moved to the GPU once, before the first job, so the jobs differ
only in the optimizer, and each job's optimizer is closed (host buffers freed) before the next. Per job:
median ms/iter (iterations 3 on), the engine's host bytes, host_plan's prediction, the peak host RSS of the job
(VmHWM, reset before it through /proc/self/clear_refs) and the CPU step's speculated units.

  python3 tools/cpu_side_measure.py --out DIR [override ...] [--jobs 0 2048 1048576 0:0 1048576:0]

A job is MIB (optimizer.speculation_buffer_mb) or MIB:CLIP (and optimizer.clip_grad=CLIP: with 0 no step is
clipped, so every step can commit its guesses; with the default 1.0 early steps are clipped and a clipped step
turns speculation off until an unclipped one).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine import cli  # noqa: E402
from engine import engine as engine_module  # noqa: E402
from engine.config import load_config  # noqa: E402
from engine.optim.host_plan import cpu_side_host_bytes  # noqa: E402

SHAPE = [  # the 8 B shape of the scale figures: hidden 4096 x 40 layers, stdlib bytes (vocab 256), f=0.3
    "model.hidden_size=4096", "model.num_layers=40", "model.num_attention_heads=32", "model.seq_length=2048",
    "model.vocab_size=256", "train.precision=bf16", "train.params_dtype=half", "train.micro_batch_size=1",
    "train.global_batch_size=8", "train.train_iters=8", "train.device=cuda", "optimizer.lr_warmup_iters=0",
    "optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=0.3",
    "optimizer.overlap_cpu_optimizer_d2h_h2d=true", "optimizer.use_distributed_optimizer=true",
    "data.source=stdlib", "logging.progress_bar=false",
]  # fmt: skip
GIB = 1 << 30


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", nargs="+", default=["0", "2048", str(1 << 20)])
    ap.add_argument("overrides", nargs="*", help="more dotted overrides after the 8 B shape's")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    built: dict[str, torch.nn.Module] = {}
    build = engine_module.build_model

    def build_once(m, device, seed):  # every job trains the one model already on the GPU
        return built["model"]

    jobs: list = []
    initialize = cli.initialize

    def keep(*args, **kw):
        res = initialize(*args, **kw)
        jobs.append(res[0])
        return res

    cfg0 = load_config({}, overrides=SHAPE + a.overrides)
    t = time.perf_counter()
    torch.manual_seed(cfg0.train.seed)
    cuda = cfg0.train.device != "cpu"  # train.device=cpu: a smoke test of this script without a GPU
    device = torch.device("cuda" if cuda else "cpu")
    model = build(cfg0.model, device, cfg0.train.seed)
    built["model"] = model.to(torch.bfloat16).to(device)
    del model
    gc.collect()
    print(f"model built in {time.perf_counter() - t:.1f} s: "
          f"{sum(p.numel() for p in built['model'].parameters()) / 1e9:.3f} B parameters", flush=True)  # fmt: skip
    engine_module.build_model = build_once
    cli.initialize = keep

    rows = []
    print(HEADER, flush=True)
    for job in a.jobs:
        mb, _, clip = job.partition(":")
        mb = int(mb)
        metrics = out / f"spec_{job.replace(':', '_clip')}.jsonl"
        extra = [f"optimizer.speculation_buffer_mb={mb}", f"logging.metrics_file={metrics}"]
        cfg = load_config({}, overrides=SHAPE + a.overrides + extra + ([f"optimizer.clip_grad={clip}"] if clip else []))
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base_rss, hwm_ok = _status("VmRSS"), _reset_peak_rss()
        t = time.perf_counter()
        cli.train(cfg)
        wall = time.perf_counter() - t
        eng = jobs.pop()
        opt = eng.optimizer
        part = opt.cpu
        units = [part.layout.numel[u] for u in part.units]
        grad_bytes = max((g.flat.element_size() for g in part.host.grads.values()), default=4)
        plan = cpu_side_host_bytes(units, kind="adam", use_torch=False, half_bytes=2, grad_bytes=grad_bytes,
                                   speculate=True, speculation_buffer_bytes=mb << 20)  # fmt: skip
        recs = [r for r in map(json.loads, metrics.read_text().splitlines()) if "iteration" in r]  # no run header
        row = {
            "job": job,
            "speculation_buffer_mb": mb,
            "clip_grad": cfg.optimizer.clip_grad,
            "ms_per_iter": statistics.median(r["iteration_ms"] for r in recs[2:]) if len(recs) > 2 else None,
            "ms_all": [round(r["iteration_ms"], 1) for r in recs],
            "losses": [round(r["loss"], 4) for r in recs],
            "host_bytes_engine": eng.host_bytes(),
            "host_bytes_plan": sum(plan.values()),
            "plan_parts": plan,
            "peak_rss_bytes": _status("VmHWM") if hwm_ok else None,
            "rss_before_bytes": base_rss,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
            "speculated_units_last_step": part.timing.get("speculated"),
            "cpu_units": len(units),
            "cpu_step_compute_s": part.timing.get("compute_s"),
            "cpu_step_run_s": part.timing.get("run_s"),
            "wall_s": wall,
        }
        rows.append(row)
        (out / f"spec_{job.replace(':', '_clip')}.json").write_text(json.dumps(row, indent=1))
        opt.close()  # the hooks on the shared model go, the host buffers are freed before the next job
        del eng, opt, part
        gc.collect()
        print(_row(row), flush=True)
    (out / "cpu_side.json").write_text(json.dumps(rows, indent=1))
    print("\n" + HEADER)
    for r in rows:
        print(_row(r))


HEADER = ("spec MiB:clip | ms/iter | host (engine) GiB | host (plan) GiB | peak RSS GiB (before) | peak GPU GiB | "
          "speculated/units")  # fmt: skip


def _row(r: dict) -> str:
    rss = "n/a" if r["peak_rss_bytes"] is None else f"{r['peak_rss_bytes'] / GIB:.1f}"
    ms = "n/a" if r["ms_per_iter"] is None else f"{r['ms_per_iter']:.1f}"
    return (f"{r['speculation_buffer_mb']:>8}:{r['clip_grad']:<4g} | {ms:>7} | {r['host_bytes_engine'] / GIB:17.2f} | "
            f"{r['host_bytes_plan'] / GIB:15.2f} | {rss:>8} ({r['rss_before_bytes'] / GIB:.1f}) | "
            f"{r['peak_gpu_bytes'] / GIB:12.1f} | {r['speculated_units_last_step']}/{r['cpu_units']}")  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
