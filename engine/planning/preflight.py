"""Pre-flight: `initialize` plans memory before anything large is allocated, resolves "auto", and refuses a
config whose plan exceeds the GPU's or the host's budget with one line naming the numbers and the key to change.

It also keeps the plan it checked last, so a CUDA out-of-memory error later in the run can say what the plan
said next to what failed (`oom_line`, used by bin/train).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from engine import dist
from engine.config import Config, ConfigError
from engine.optim.blockwise import NAME as BLOCKWISE
from engine.planning import oom, planner, resolve
from engine.planning.auto import NothingFits, Planner, gib
from engine.planning.budget import Budgets
from engine.planning.memory import Plan

_last: tuple[Config, Plan] | None = None  # (the resolved config, its plan), for oom_line


def check(cfg: Config, model: nn.Module | None, device: torch.device, world: int, budgets: Budgets | None = None,
          example_batch: Any = None, loss_fn: Any = None, batch_name: str = "example batch") -> Config:  # fmt: skip
    """The config with "auto" values chosen; ConfigError (one line) when the plan does not fit.

    On a CPU run the GPU check does not apply (the device is the host; the host check does). A given model's
    activations are measured at `example_batch` (engine.planning.batch); without one they are not counted (the
    refusal is then on weights and optimizer alone, a lower bound) and "auto" is refused: initialize then checks
    again at the first micro-batch, and chooses "auto" there (engine.first_batch)."""
    global _last
    budgets = budgets or Budgets()
    p = planner(cfg, model, gpu_budget_bytes=budgets.gpu_bytes, host_budget_bytes=budgets.host_bytes,
                device=device.type, data_parallel_size=world, measure_activations=False,
                example_batch=example_batch, loss_fn=loss_fn, measure_rates=_chooses(cfg),
                batch_name=batch_name)  # fmt: skip
    try:
        plan = resolve(p)
    except NothingFits as e:
        raise ConfigError([str(e)]) from None
    resolved = _with_resolved(cfg, plan)
    _last = (resolved, plan)
    if not plan.memory_fits:
        raise ConfigError([refusal(p, plan)])
    chosen = [f"{key}={_value(resolved, key)}" for key, auto in plan.auto.items() if auto]
    if chosen:
        dist.log(f"memory plan chose {', '.join(chosen)} (GPU {gib(plan.gpu.total_bytes)} of "
                 f"{_budget(plan.gpu.budget_bytes)} GiB, host {gib(plan.host.total_bytes)} of "
                 f"{_budget(plan.host.budget_bytes)} GiB{_predicted(plan)}; bin/train CONFIG --plan shows the "
                 "parts)")  # fmt: skip
    return resolved


def _chooses(cfg: Config) -> bool:
    """Whether the plan chooses a value ("auto"): only then do the rates matter to the run, and are measured."""
    m = cfg.model
    return "auto" in (cfg.optimizer.optimizer_offload_fraction, m.cpu_offloading_num_layers, m.recompute_num_layers)


def _predicted(plan: Plan) -> str:
    return "" if plan.step_time is None else f"; predicted step {1000 * plan.step_time.total_s:,.0f} ms, {plan.costs}"


def last() -> tuple[Config, Plan] | None:
    """The config and plan `check` accepted or refused last in this process."""
    return _last


def _budget(n: int | None) -> str:
    return "?" if n is None else gib(n)


def _value(cfg: Config, dotted: str) -> object:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _with_resolved(cfg: Config, plan: Plan) -> Config:
    o, m = cfg.optimizer, cfg.model
    if o.optimizer_offload_fraction == "auto":
        cfg = replace(cfg, optimizer=replace(o, optimizer_offload_fraction=plan.fraction))
    if m.cpu_offloading_num_layers == "auto":
        m = replace(m, cpu_offloading_num_layers=plan.offloaded_layers)
    if m.recompute_num_layers == "auto":
        m = replace(m, recompute_num_layers=plan.recomputed_layers)
    return replace(cfg, model=m) if m is not cfg.model else cfg


def refusal(p: Planner, plan: Plan) -> str:
    """One line: which memory, the plan's bytes against the budget, and the key (and bound) that would fit."""
    o, m = p.cfg.optimizer, p.cfg.model
    k, fraction = plan.offloaded_layers, plan.fraction
    if not plan.gpu.fits:
        what = f"GPU memory: plan needs {gib(plan.gpu.total_bytes)} GiB, {gib(plan.gpu.budget_bytes)} GiB available"
        lowest = p.smallest_gpu_fraction(k, None if o.optimizer_cpu_offload else p.with_optimizer_offload())
        if lowest is not None and lowest.host.fits:
            if o.optimizer_cpu_offload:
                return f'{what}; raise optimizer.optimizer_offload_fraction to >= {lowest.fraction:.2f} (or "auto")'
            return (f"{what}; set optimizer.optimizer_cpu_offload=true and optimizer.use_distributed_optimizer=true "
                    f'with optimizer.optimizer_offload_fraction >= {lowest.fraction:.2f} (or "auto")')  # fmt: skip
        layers = p.fewest_gpu_layers(fraction) if m.cpu_offloading else None
        if layers is not None and p.evaluate(fraction, layers).host.fits:
            return f'{what}; raise model.cpu_offloading_num_layers to >= {layers} (or "auto")'
        narrow = _narrower_states(p, plan, "GPU")  # the GPU-stepped part's states narrow too
        if narrow is not None:
            return f"{what}; {narrow}; at the current state dtypes, {p.largest_model_hint()}"
        return f"{what}; nothing fits at this shape: {p.largest_model_hint()}"
    what = f"host memory: plan needs {gib(plan.host.total_bytes)} GiB, {gib(plan.host.budget_bytes)} GiB available"
    if plan.host.phase == "construction":
        return (f"{what} while the given model is on the host ({gib(plan.host.parts.get('model_construction', 0))}"
                ' GiB); build it on the GPU or under torch.device("meta"), or use a smaller model')  # fmt: skip
    if plan.host.phase == "checkpoint" and _fits_without_checkpoint(p, plan):
        return (
            f"{what} when a checkpoint is saved (the optimizer's fp32 state copied to the host, "
            f"{gib(plan.host.parts['checkpoint_state_copy'])} GiB); unset checkpoint.save or free host memory"
        )
    fix = None
    if fraction > 0:
        highest = p.largest_host_fraction(k)
        if highest is not None and p.evaluate(highest, k).gpu.fits:
            fix = f"lower optimizer.optimizer_offload_fraction to <= {highest:.2f}"
    if fix is None and k > 0:  # the most layers whose pool fits the host; fewer only lose GPU memory
        fewer = p.most_host_layers(fraction, below=k)
        if fewer is not None and p.evaluate(fraction, fewer).fits:
            fix = f"lower model.cpu_offloading_num_layers to <= {fewer}"
    narrow = _narrower_states(p, plan)  # keeps the model and the split, changing the CPU part's state dtypes
    if narrow is not None:
        either = f"{fix}, or {narrow}" if fix else narrow
        return f"{what}; {either}; at the current state dtypes, {p.largest_model_hint()}"
    if fix is not None:
        return f"{what}; {fix}"
    return f"{what}; nothing fits at this shape: {p.largest_model_hint()}"


def _narrower_states(p: Planner, plan: Plan, side: str = "host") -> str | None:
    """The first narrower state form (both parts of the split narrow) that fits at this fraction and layer count, as
    the keys to set and the bytes it plans on `side` ("host" or "GPU"): the remainder master alone (exact), bf16
    moments, then both, then block-wise 8-bit moments alone and with the remainder master. None where the states
    cannot narrow (not the engine's AdamW, the GPU assist; on the host: no CPU-stepped part) or none fits."""
    o, t, s = p.cfg.optimizer, p.cfg.train, p.settings
    no_cpu_part = plan.fraction == 0 or not o.optimizer_cpu_offload
    torch_cpu = o.optimizer_cpu_offload and o.use_torch_optimizer_for_cpu_offload
    if ((side == "host" and no_cpu_part) or o.implementation != "engine" or o.optimizer != "adam" or torch_cpu
            or o.cpu_offload_gpu_assist):  # fmt: skip
        return None
    forms: list[tuple[list[str], dict]] = []
    rem = ["optimizer.store_param_remainders=true"], {"remainders": True}
    bf16 = (
        ["optimizer.exp_avg_dtype=bf16", "optimizer.exp_avg_sq_dtype=bf16"],
        {"moment_bytes": (2, 2), "moment_coded": (False, False)},
    )
    q8 = ([f"optimizer.exp_avg_dtype={BLOCKWISE}", f"optimizer.exp_avg_sq_dtype={BLOCKWISE}"],
          {"moment_bytes": (1, 1), "moment_coded": (True, True)})  # fmt: skip
    can_rem = not s.remainders and t.precision == "bf16" and t.params_dtype == "half"
    if can_rem:
        forms.append(rem)
    for moments, narrower in ((bf16, sum(s.moment_bytes) > 4), (q8, s.moment_coded != (True, True))):
        if narrower:  # exact forms first, then the narrower moments alone, then with the remainder master
            forms.append(moments)
            if can_rem:
                forms.append((rem[0] + moments[0], {**rem[1], **moments[1]}))
    for keys, change in forms:
        trial = p.evaluate(plan.fraction, plan.offloaded_layers, replace(s, **change))
        if trial.fits:
            switch = [] if o.use_precision_aware_optimizer else ["optimizer.use_precision_aware_optimizer=true"]
            on = trial.host if side == "host" else trial.gpu
            return f"set {' '.join(switch + keys)} ({side} {gib(on.total_bytes)} GiB)"
    return None


def _fits_without_checkpoint(p: Planner, plan: Plan) -> bool:
    """Whether the same settings fit once checkpoint.save is unset (else that advice would not help)."""
    return p.evaluate(plan.fraction, plan.offloaded_layers, replace(p.settings, checkpoint_save=False)).fits


def oom_line(error: BaseException) -> str:
    """A CUDA out-of-memory error as one line: what the plan said, what failed, which keys to change."""
    if isinstance(error, oom.PlannedOutOfMemoryError):  # the engine's, already one line
        return str(error)
    return oom.line(error, _last)
