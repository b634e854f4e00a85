"""The rows of `bin/bench scale` run: each row's config, its model trained through the engine and freed, in turn.

A shape (engine.bench.scale.Shape, the built-in GPT; engine.bench.hf_scale.HFShape, a HF causal LM) says what it
is: `layers`, `seq`, `params()`, `flops_per_token()`, `model_section()` (its config keys), `build(device, seed,
cfg)`, `batches(tokens, micro_batch, seed)`, and `planned_at_a_batch` (its first micro-batch is the plan's
example_batch).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import resource
import statistics
import time
import weakref

import torch

from engine.bench.scale_rows import Row, write_json
from engine.config import ConfigError, load_config
from engine.config.rules import CPU_PART_KEYS
from engine.planning.budget import Budgets

COMMAND = "bin/bench scale"


def _rss_bytes() -> int:
    """The process's resident memory now (Linux); elsewhere its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def row_config(a: argparse.Namespace, shape, fraction: float | str, dpu: bool, extra: dict | None = None,
            pin: bool = False) -> dict:  # fmt: skip
    offload = fraction == "auto" or fraction > 0
    cfg = {
        "model": shape.model_section(),  # a HF shape: none (the model brings its own)
        "optimizer": {"optimizer": "adam", "lr": a.lr,
                      "lr_warmup_iters": a.lr_warmup, "lr_decay_iters": max(a.lr_warmup, 1),
                      "lr_decay_style": "constant",
                      "weight_decay": 0.1, "adam_beta1": 0.9,
                      "adam_beta2": 0.95, "clip_grad": 1.0, "optimizer_cpu_offload": offload,
                      "optimizer_offload_fraction": fraction, "overlap_cpu_optimizer_d2h_h2d": offload,
                      "use_distributed_optimizer": offload, "cpu_optimizer_pin_threads": pin and offload},
        "train": {"train_iters": a.warmup + a.iters, "global_batch_size": a.global_batch,
                  "micro_batch_size": a.micro_batch, "precision": "bf16", "params_dtype": "half", "seed": a.seed,
                  "device": a.device},
        "logging": {"metrics_file": None, "progress_bar": False},
    }  # fmt: skip
    if dpu:  # a short warm-up: the measured iterations are delayed ones
        cfg["optimizer"].update(delayed_param_update=True, delayed_param_update_warmup=a.dpu_warmup)
    given = {**({"optimizer.cpu_optimizer_threads": a.cpu_threads} if a.cpu_threads else {}), **a.set, **(extra or {})}
    for path, value in given.items():
        if not offload and path in CPU_PART_KEYS:  # the twin has no CPU-stepped part for them to act on
            continue
        ns, key = path.split(".", 1)
        cfg.setdefault(ns, {})[key] = value
    return cfg


def dpu_unavailable(a: argparse.Namespace, shape, fraction: float | str) -> str | None:
    """Why this checkout cannot run the DPU row (the config's own message), or None when it can."""
    try:
        load_config(row_config(a, shape, fraction, True))
    except ConfigError as e:
        return "; ".join(e.errors)
    return None


def empty_caches() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        for name in ("_host_emptyCache", "_cuda_hostEmptyCache"):  # pinned blocks torch's host allocator keeps
            if hasattr(torch._C, name):
                getattr(torch._C, name)()
                break


def budgets(a: argparse.Namespace) -> Budgets:
    """--gpu-memory / --host-memory: the budgets every row's plan is made against (None: this machine's)."""
    return Budgets(a.gpu_memory, a.host_memory)


def run_row(a: argparse.Namespace, name: str, shape, fraction: float | str, dpu: bool, tokens,
            pin: bool = False, overrides: dict | None = None) -> Row:  # fmt: skip
    """Train `shape` (engine.bench.scale.Shape, the built-in GPT, or engine.bench.hf_scale.HFShape) for warmup +
    iters steps through the engine, then free everything it built."""
    from engine.engine import initialize

    row = Row(name, shape.layers, shape.params(), fraction, dpu, pin, overrides=dict(overrides or {}))
    device = torch.device(a.device)
    t0 = time.perf_counter()
    cfg = row_config(a, shape, fraction, dpu, overrides, pin=pin)
    # a delayed row's first steps are exact ones: measuring them would report the exact step under the delayed name
    o = load_config(cfg).optimizer  # a config the engine refuses says so before this row's own check
    exact_steps = o.delayed_param_update_warmup if o.delayed_param_update else 0
    first = max(a.warmup, exact_steps)
    if first >= a.warmup + a.iters:
        raise ValueError(f"--warmup {a.warmup} --iters {a.iters} measure no delayed step of the {name} row (its first "
                         f"{exact_steps} steps are exact: optimizer.delayed_param_update_warmup); raise --iters above "
                         f"{exact_steps - a.warmup}")  # fmt: skip
    data = shape.batches(tokens, a.micro_batch, a.seed)
    if a.implementation == "megatron":  # megatron-core's GPTModel, built by the engine on the device in bf16
        cfg["model"].update(implementation="megatron", use_te=a.te)
        torch.manual_seed(a.seed)
        eng, _, _ = initialize(config=cfg, memory_budgets=budgets(a))
    else:  # a HF model's plan measures its first micro-batch (example_batch), which is then trained on
        batch = next(data) if shape.planned_at_a_batch else None
        eng, _, _ = initialize(model=shape.build(device, a.seed, cfg), config=cfg, memory_budgets=budgets(a),
                               example_batch=batch)  # fmt: skip
        data = data if batch is None else itertools.chain([batch], data)
    row.setup_s = time.perf_counter() - t0
    if eng.planned is not None:  # the plan the pre-flight accepted (on a CPU run its "GPU" is the host too)
        planned = eng.planned[1]
        row.plan_host_bytes, row.cpu_params = planned.host.total_bytes, planned.cpu_parameters
        row.plan_gpu_bytes = planned.gpu.total_bytes if planned.gpu.device == "cuda" else None
    row.fraction = float(eng.config.optimizer.optimizer_offload_fraction)  # "auto" resolved by the plan
    row.dpu = bool(eng.config.optimizer.delayed_param_update)
    alive = weakref.ref(eng.module)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, cpu_steps, rss = [], [], []
    opt = eng.optimizer
    for i in range(a.warmup + a.iters):
        t = time.perf_counter()
        row.losses.append(eng.train_batch(data))  # .item() of the loss: waits for the GPU's work, not the CPU step
        times.append(time.perf_counter() - t)
        rss.append(_rss_bytes())
        if eng.last_step_delayed:
            row.delayed_steps.append(eng.iteration)
        timing = opt.cpu_step_timing()
        if timing is not None and i > first:  # the previous step's, with this step's GPU waits for it
            cpu_steps.append(timing)
    eng.synchronize()
    row.step_ms, row.measured_from = [1e3 * t for t in times], first
    row.iter_ms = statistics.median(row.step_ms[first:])
    row.tokens_per_s = a.global_batch * shape.seq / (row.iter_ms / 1e3)
    row.tflops = row.tokens_per_s * shape.flops_per_token()["total"] / 1e12
    row.peak_gpu_bytes = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    row.host_engine_bytes = eng.host_bytes()
    row.host_rss_bytes = max(rss)
    if cpu_steps:
        med = lambda key: 1e3 * statistics.median(t[key] for t in cpu_steps)  # noqa: E731
        row.cpu_step_ms, row.speculated_ms, row.gpu_wait_ms = med("compute_s"), med("speculated_s"), med("gpu_wait_s")
        row.guesses = f"{sum(t['committed'] for t in cpu_steps):.0f}/{sum(t['speculated'] for t in cpu_steps):.0f}"
        row.hidden_ms = max(0.0, row.cpu_step_ms - row.gpu_wait_ms)
        rates = [t["stepped_params"] * t["pass_bytes"] / t["compute_s"] for t in cpu_steps
                 if t["pass_bytes"] and t["compute_s"] > 0]  # fmt: skip
        if rates:
            row.cpu_pass_bytes, row.cpu_gbs = cpu_steps[-1]["pass_bytes"], statistics.median(rates) / 1e9
    if hasattr(opt, "close"):
        opt.close()  # its hooks on the model hold it, and its threads and host buffers
    del eng, opt, data
    empty_caches()
    if alive() is not None:
        raise RuntimeError(f"{COMMAND}: the {name} model is still referenced after its run; the next would not fit")
    return row


def deep_rows(a: argparse.Namespace, shape, fraction: float | str) -> list[tuple]:
    """(name, shape, fraction, dpu, pin, overrides) of the deep shape's rows: --rows, --fractions, --variant."""
    wanted, pin = set(a.rows.split(",")), a.pin_threads == "on"
    out = [("exact", shape, fraction, False, pin, {})] if "exact" in wanted else []
    if "exact" in wanted and a.pin_threads == "both":
        out.append(("exact+pin", shape, fraction, False, True, {}))
    if "dpu" in wanted:
        out.append(("dpu", shape, fraction, True, pin, {}))
    out += [(f"f={f:g}", shape, f, False, pin, {}) for f in a.fractions]
    return out + [(name, shape, fraction, False, pin, over) for name, over in a.variant]


def run_rows(a: argparse.Namespace, plan: list[tuple], tokens) -> list[Row]:
    """Each planned row trained in turn; one the engine or CUDA refuses is a row saying why."""
    rows = []
    for name, shp, f, dpu, pinned, over in plan:
        why = dpu_unavailable(a, shp, f) if dpu else None
        if why:
            row = Row(name, shp.layers, shp.params(), f, dpu, pinned, unavailable=why)
        else:
            try:
                row = run_row(a, name, shp, f, dpu, tokens, pin=pinned, overrides=over)
            except (ConfigError, ValueError, torch.OutOfMemoryError) as e:  # the plan's refusal, or CUDA's
                row = Row(name, shp.layers, shp.params(), f, dpu, pinned, overrides=over,
                          unavailable=str(e).splitlines()[0])  # fmt: skip
        if row.unavailable:
            empty_caches()  # after the except block: its traceback held the failed row's model
            print(f"  {name}: not available: {row.unavailable}", flush=True)
        else:
            print(f"  done {name}: {row.iter_ms:.1f} ms/iter, setup {row.setup_s:.1f} s, "
                  f"{len(row.delayed_steps)} delayed steps, losses "
                  + " ".join(f"{x:.3f}" for x in row.losses), flush=True)  # fmt: skip
        rows.append(row)
        write_json(a, rows)
    return rows
