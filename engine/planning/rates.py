"""The rates "auto" prices its candidates with (engine.planning.step_time.Costs): measured where the run trains.

The stated defaults (step_time.default_costs) are one machine's; host memory and PCIe differ between machines and
between leases of one machine type (the engine's CPU AdamW step measured 3.7-5.6 G params/s on the same H200
type). Before the plan chooses for a run on CUDA, it measures what the candidates' prices depend on, in well under
two seconds, each only where it matters to this config:

  PCIe each way   a COPY_BYTES copy between a pinned host buffer (registered as the optimizer's are) and the GPU,
                  each way: the median of 3 after one warm-up (when the optimizer or activations are offloaded)
  CPU AdamW       the engine's own pass (engine.optim.cpu_arith.step_rate) over ADAM_PARAMS parameters in the
                  state form and at the thread count (and binding) the CPU part will run (when the engine's CPU
                  AdamW steps a part)
  GPU matmul      [GEMM_ROWS, hidden] x [hidden, hidden] in the training dtype, hidden the model's: a GEMM's rate,
                  above what a whole model achieves (attention, norms, elementwise ops), so the compute term is
                  the least a step can take

A rate the config gives (the plan section) is used as given and never measured; plan.measure_rates=false, a CPU
device, or a plan for another machine (bin/train --plan --gpu-memory) keep the stated ones. A rate whose
measurement fails (out of memory) stays stated. Each measurement runs once per process and shape.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import statistics
import time

import torch
from torch import nn

from engine.config import Config
from engine.planning.memory import Settings
from engine.planning.step_time import GB, RATES, Costs, default_costs

log = logging.getLogger(__name__)

COPY_BYTES = 256 << 20  # per direction: ~5 ms at 55 GB/s, large enough that the copy's launch does not count
ADAM_PARAMS = 8 << 20  # 128-224 MiB of state and gradient: past the caches, ~2 ms a step at 4 G params/s
GEMM_ROWS = 4096  # tokens of the measuring matmul
SCALE = {  # the config's units -> Costs'
    "pcie_d2h_bytes_per_s": GB,
    "pcie_h2d_bytes_per_s": GB,
    "cpu_params_per_s": 1e9,
    "flops_per_s": 1e12,
}
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def for_plan(cfg: Config, settings: Settings, model: nn.Module | None, *, here: bool) -> Costs | None:
    """The rates a CUDA plan prices with, measured (see the module docstring) where plan.measure_rates asks (null:
    when `here`, the plan being for a run on this machine's GPU; true: always; false: never) and this machine has
    CUDA; None: the stated ones."""
    asked = cfg.plan.measure_rates
    device = cuda_device() if asked is not False and (asked or here) else None
    if device is None:
        return None
    return measured(cfg, settings, device=device, hidden=gemm_hidden(cfg, model))


def cuda_device() -> torch.device | None:
    """This process's CUDA device, or None without one."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def stated(cfg: Config, *, cuda: bool) -> Costs:
    """The stated defaults for the device, with the rates the config gives (plan.*) in their place."""
    base = default_costs(cuda=cuda, precision=cfg.train.precision)
    given = {name: getattr(cfg.plan, key.split(".")[1]) for name, key in RATES.items()}
    given = {name: value * SCALE[name] for name, value in given.items() if value is not None}
    return dataclasses.replace(base, **given, given=frozenset(given))


def measured(cfg: Config, settings: Settings, *, device: torch.device, hidden: int) -> Costs:
    """`stated(cfg)` with each rate that matters to this config and is not given measured on `device` (CUDA)."""
    costs = stated(cfg, cuda=True)
    todo = [name for name in matters(cfg, settings) if name not in costs.given]
    found: dict[str, float] = {}
    if "pcie_d2h_bytes_per_s" in todo or "pcie_h2d_bytes_per_s" in todo:
        pcie = _tried("PCIe copies", pcie_rates, str(device))
        if pcie is not None:
            pairs = zip(("pcie_d2h_bytes_per_s", "pcie_h2d_bytes_per_s"), pcie, strict=True)
            found.update({k: v for k, v in pairs if k in todo})
    if "cpu_params_per_s" in todo:
        rate = _tried("the CPU AdamW step", cpu_adam_rate, *cpu_form(cfg, settings))
        if rate is not None:
            found["cpu_params_per_s"] = rate
    if "flops_per_s" in todo:
        rate = _tried("a matmul", matmul_rate, str(device), hidden, HALF[cfg.train.precision])
        if rate is not None:
            found["flops_per_s"] = rate
    return dataclasses.replace(costs, **found, measured=frozenset(found))


def matters(cfg: Config, s: Settings) -> list[str]:
    """The rates the candidates' prices depend on under this config (Costs field names)."""
    o = cfg.optimizer
    names = ["flops_per_s"]
    if s.cpu_offload or s.layer_offload:
        names += ["pcie_d2h_bytes_per_s", "pcie_h2d_bytes_per_s"]
    if s.cpu_offload and o.implementation == "engine" and o.optimizer == "adam" and not s.use_torch:
        names.append("cpu_params_per_s")
    return names


def cpu_form(cfg: Config, s: Settings) -> tuple:
    """cpu_adam_rate's arguments for the CPU part this config builds: threads, moments' dtypes, gradient dtype,
    half weights written (None: fp32 weights), remainder master, threads bound (engine.build's HybridOptions)."""
    from engine.optim.hybrid import default_cpu_threads
    from engine.optim.options import STATE_DTYPE

    o = cfg.optimizer
    weight = HALF[cfg.train.precision] if s.half else torch.float32
    grad = torch.float32 if s.main_grads else weight
    half = weight if s.half and not s.remainders else None
    return (o.cpu_optimizer_threads or default_cpu_threads(), STATE_DTYPE[o.exp_avg_dtype],
            STATE_DTYPE[o.exp_avg_sq_dtype], grad, half, s.remainders, o.cpu_optimizer_pin_threads)  # fmt: skip


def gemm_hidden(cfg: Config, model: nn.Module | None) -> int:
    """The hidden size of the model's matmuls: the built-in GPT's and megatron's model.hidden_size; a user's model's
    config.hidden_size (HF), else the most common input width of its linear layers."""
    if model is None:
        return cfg.model.hidden_size
    h = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(h, int) and h > 0:
        return h
    widths = collections.Counter(m.in_features for m in model.modules() if isinstance(m, nn.Linear))
    return widths.most_common(1)[0][0] if widths else cfg.model.hidden_size


def _tried(what: str, measure, *args):
    """measure(*args), or None (the rate stays stated, with a log line) where it fails for lack of memory."""
    try:
        return measure(*args)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        log.warning("the memory plan could not measure %s (%s); it prices with the stated rate", what,
                    str(e).splitlines()[0] if str(e) else type(e).__name__)  # fmt: skip
        return None


@functools.cache
def pcie_rates(device: str, nbytes: int = COPY_BYTES, reps: int = 3) -> tuple[float, float]:
    """(device-to-host, host-to-device) bytes per second of pinned copies of `nbytes`."""
    from engine.optim.host_buffers import flat_buffer

    host = flat_buffer(nbytes, torch.uint8, pin=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    d2h = _cuda_seconds(lambda: host.copy_(gpu, non_blocking=True), reps)
    h2d = _cuda_seconds(lambda: gpu.copy_(host, non_blocking=True), reps)
    return nbytes / d2h, nbytes / h2d


@functools.cache
def cpu_adam_rate(threads: int, m: torch.dtype, v: torch.dtype, grad: torch.dtype, half: torch.dtype | None,
                  remainders: bool, pin: bool, numel: int = ADAM_PARAMS) -> float:  # fmt: skip
    """Parameters per second of the engine's CPU AdamW step (engine.optim.cpu_arith.step_rate) in this form."""
    from engine.optim import affinity
    from engine.optim.cpu_arith import step_rate

    workers, _ = affinity.initializers(pin)
    return step_rate(numel, threads, moments=(m, v), grad=grad, half=half, remainders=remainders,
                     initializer=workers)  # fmt: skip


@functools.cache
def matmul_rate(device: str, hidden: int, dtype: torch.dtype, rows: int = GEMM_ROWS, reps: int = 10) -> float:
    """FLOP/s of a [rows, hidden] x [hidden, hidden] matmul in `dtype` on `device` (CUDA, or the CPU)."""
    a = torch.ones(rows, hidden, dtype=dtype, device=device)
    b = torch.full((hidden, hidden), 1e-3, dtype=dtype, device=device)
    out = torch.empty(rows, hidden, dtype=dtype, device=device)
    run = functools.partial(torch.mm, a, b, out=out)
    seconds = _cuda_seconds(run, reps, warmup=3) if torch.device(device).type == "cuda" else _host_seconds(run, reps)
    return 2 * rows * hidden * hidden / seconds


def _cuda_seconds(fn, reps: int, warmup: int = 1) -> float:
    """The median seconds of fn's work on the current CUDA stream, after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def _host_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
