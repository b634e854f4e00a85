"""The memory plan: the bytes each device will hold, by part, for a config and optionally a user's model.

    import engine
    p = engine.plan("configs/13b-h200.json", gpu_budget_bytes=139 << 30, host_budget_bytes=125 << 30)
    p.fits, p.fraction, p.offloaded_layers, p.gpu.parts, p.host.total_bytes, p.to_json()

Pure: nothing is changed and nothing large is kept (the built-in GPT is built on the meta device; a user's model
runs one forward of its batch to measure its activations, RNG state restored; on CUDA the rates the step time is
priced with are measured with a few hundred MiB for a moment: engine.planning.rates). The parts and
phases are engine.planning.memory's, the activations engine.planning.activations', "auto" engine.planning.auto's; this
module puts them together and renders them for `bin/train --plan` (a table) and `--plan --json`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from engine.config import Config, load_config
from engine.offload.api import DEFAULT_MIN_BYTES
from engine.planning import budget, rates
from engine.planning.auto import NothingFits, Planner, gib
from engine.planning.census import builtin_census, model_census
from engine.planning.memory import DevicePlan, Plan, settings_of
from engine.planning.step_time import Costs

__all__ = ["DevicePlan", "NothingFits", "Plan", "format_plan", "plan", "planner"]


def target_is_cuda(cfg: Config, device: str | None, gpu_budget_bytes: int | None) -> bool:
    """The device planned for: as given; CUDA when a GPU budget is given (sizing a GPU job from anywhere);
    else train.device, with "auto" meaning CUDA where torch sees one."""
    if device is not None:
        return device == "cuda"
    if gpu_budget_bytes is not None:
        return True
    return cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())


def planner(
    config: str | os.PathLike[str] | Mapping[str, Any] | Config,
    model: nn.Module | None = None,
    *,
    gpu_budget_bytes: int | None = None,
    host_budget_bytes: int | None = None,
    device: str | None = None,
    data_parallel_size: int | None = None,
    measure_activations: bool = True,
    example_input: Callable[[int, int, torch.device], tuple[Any, ...]] | None = None,
    example_batch: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    costs: Costs | None = None,
    measure_rates: bool | None = None,
    batch_name: str = "example batch",
) -> Planner:
    """The Planner behind `plan` (the pre-flight also asks it for the bounds a refusal names). batch_name: what
    example_batch is, for the plan's source line (the engine's first micro-batch, or an example batch)."""
    cfg = config if isinstance(config, Config) else load_config(config)
    cuda = target_is_cuda(cfg, device, gpu_budget_bytes)
    world = data_parallel_size or int(os.environ.get("WORLD_SIZE", "1"))
    gpu = gpu_budget_bytes
    if gpu is None and cuda:
        gpu = budget.gpu_free(torch.device("cuda", torch.cuda.current_device())) if torch.cuda.is_available() else None
    # the ranks of one machine share its host memory
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    host = host_budget_bytes if host_budget_bytes is not None else budget.host_available() // local
    if model is None and cfg.model.implementation == "megatron":
        from engine.planning.megatron import megatron_census

        census = megatron_census(cfg, cuda=cuda)
    elif model is None:
        census = builtin_census(cfg, cuda=cuda)
    else:
        census = model_census(cfg, model, cuda=cuda, measure=measure_activations, example_input=example_input,
                              example_batch=example_batch, loss_fn=loss_fn, batch_name=batch_name)  # fmt: skip
    tokens = batch_tokens(example_batch) if example_batch is not None else None
    settings = settings_of(cfg, world)
    if costs is None and cuda:
        here = measure_rates if measure_rates is not None else gpu_budget_bytes is None  # a run on this machine
        costs = rates.for_plan(cfg, settings, model, here=here)
    return Planner(cfg, census, settings, cuda=cuda, gpu_budget=gpu, host_budget=host, costs=costs,
                   tokens=tokens)  # fmt: skip


def plan(
    config: str | os.PathLike[str] | Mapping[str, Any] | Config,
    model: nn.Module | None = None,
    *,
    gpu_budget_bytes: int | None = None,
    host_budget_bytes: int | None = None,
    device: str | None = None,
    data_parallel_size: int | None = None,
    measure_activations: bool = True,
    example_input: Callable[[int, int, torch.device], tuple[Any, ...]] | None = None,
    example_batch: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    costs: Costs | None = None,
    measure_rates: bool | None = None,
) -> Plan:
    """The memory plan of `config` (a path, dict or Config) for the built-in GPT, or for `model`.

    gpu_budget_bytes / host_budget_bytes: plan for another machine (None: this one's free CUDA memory and the
    host memory available to this process). A GPU budget makes the plan assume CUDA (pinned pools, CUDA's
    kernels) whatever this machine has; device="cpu" / "cuda" says so explicitly. "auto" values are resolved
    (NothingFits, a ValueError, when none fits). example_input(batch, seq, device) -> forward args for a user
    model whose forward does not take token ids [batch, seq].

    example_batch: one micro-batch as `train_batch` will get it (a dict with `input_ids`/`labels`, `(inputs,
    labels)`, a tensor), with `loss_fn` as given to engine.initialize: a user model's activations, logits and
    loss are measured by one forward of it (engine.planning.batch). Without it they are measured at
    model.seq_length, a guess: the plan then reports no fit and "auto" is refused (engine.initialize without one
    plans at the first micro-batch: engine.first_batch).

    costs: the rates the step time is predicted with (engine.planning.step_time.Costs); None: measured on this
    machine's GPU when the plan is for it (CUDA here and no gpu_budget_bytes; measure_rates=True: whatever the
    budgets, as for a run here; False: not) or the config's plan.measure_rates=true asks, never where it is
    false; else stated. A rate the config gives (plan.*) is used as given (engine.planning.rates)."""
    p = planner(config, model, gpu_budget_bytes=gpu_budget_bytes, host_budget_bytes=host_budget_bytes,
                device=device, data_parallel_size=data_parallel_size, measure_activations=measure_activations,
                example_input=example_input, example_batch=example_batch, loss_fn=loss_fn, costs=costs,
                measure_rates=measure_rates)  # fmt: skip
    return resolve(p)


def resolve(p: Planner) -> Plan:
    """The plan at the config's values, "auto" ones chosen, priced (its predicted step time)."""
    fraction = p.cfg.optimizer.optimizer_offload_fraction
    layers = p.cfg.model.cpu_offloading_num_layers
    recompute = p.cfg.model.recompute_num_layers
    auto = {
        "optimizer.optimizer_offload_fraction": fraction == "auto",
        "model.cpu_offloading_num_layers": layers == "auto",
        "model.recompute_num_layers": recompute == "auto",
    }
    if any(auto.values()) and not p.census.batch_seen:
        keys = " and ".join(f'{k}="auto"' for k, a in auto.items() if a)
        raise NothingFits(f"{keys} needs the activations of the model's own batches: pass example_batch= (one "
                          "micro-batch) to engine.plan, or set a number (engine.initialize without one chooses at "
                          "the first micro-batch)")  # fmt: skip
    if any(auto.values()):
        chosen = p.resolve(fraction, layers, recompute)
    else:
        chosen = p.priced(p.evaluate(float(fraction), int(layers)))
    return replace(chosen, auto=auto)


def batch_tokens(batch: Any) -> int | None:
    """Tokens in one micro-batch: the elements of its first integer tensor (token ids), or None."""
    from engine.batch import BatchLoss

    args, kwargs, _ = BatchLoss.split(batch)
    ids = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    return int(ids[0].numel()) if ids else None


# --- rendering -------------------------------------------------------------------------------------------------


def _row(name: str, n: int, width: int = 34) -> str:
    return f"  {name:<{width}} {n / 2**30:>9.2f} GiB"


def _device_block(title: str, d: DevicePlan) -> list[str]:
    lines = [f"{title} (peak during {d.phase})"]
    lines += [_row(k, v) for k, v in d.parts.items() if v]
    budget_text = f"{gib(d.budget_bytes)} GiB available" if d.budget_bytes is not None else "no budget checked"
    verdict = "" if d.budget_bytes is None else ("  fits" if d.fits else "  DOES NOT FIT")
    lines.append(f"  {'total':<34} {d.total_bytes / 2**30:>9.2f} GiB  of {budget_text}{verdict}")
    lines.append("  phases: " + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in d.phases.items()))
    return lines


def _offload_lines(p: Plan, s: Any = None) -> list[str]:
    """What activation offloading will move, as the run's summary says it (engine.report), or that it moves nothing."""
    k = p.offloaded_layers
    if not k:
        return []
    if not p.offloaded_layer_bytes:
        return [
            f"  activation offload: {k} layers wrapped, but nothing moves: every storage they save is at most "
            f"{DEFAULT_MIN_BYTES} bytes (offload.DEFAULT_MIN_BYTES) or a parameter, so it stays on the device"
        ]
    per_step = k * p.offloaded_layer_bytes * (s.micro_batches if s is not None else 1)
    return [f"  activation offload: {k} layers move {per_step / 2**30:.2f} GiB to the host and back per step, "
            f"{k * p.offloaded_layer_bytes / 2**30:.2f} GiB off the GPU by the end of forward"]  # fmt: skip


def _ms(t: float) -> str:
    return f"{1000 * t:,.0f} ms"


def _time_lines(p: Plan) -> list[str]:
    """The predicted step of the plan's mix, by part, and of the runners-up "auto" weighed against it."""
    t = p.step_time
    if t is None:
        return []

    def n(x: float) -> str:
        return f"{1000 * x:,.0f}"

    cpu = f", CPU step {n(t.cpu_exposed_s)} of {n(t.cpu_step_s)} not hidden" if t.cpu_step_s else ""
    lines = [f"  predicted step: {_ms(t.total_s)}: compute {n(t.compute_s)}, copies not hidden "
             f"{n(t.activation_copies_s)}, recompute {n(t.recompute_s)}, GPU step {n(t.gpu_step_s)}{cpu}",
             f"  {p.costs}"]  # fmt: skip
    lines += [f"  next candidate: fraction {f:.2f}, {k} offloaded, {r} recomputed layers: {_ms(o.total_s)}"
              for f, k, r, o in p.next_best]  # fmt: skip
    if any(o.total_s < t.total_s for *_, o in p.next_best):
        lines.append("  (within 1% of the fastest: a tie, won by fewer offloaded or recomputed layers, then the "
                     "least fraction)")  # fmt: skip
    return lines


def _recompute_line(p: Plan, mark: dict[bool, str]) -> list[str]:
    auto = p.auto.get("model.recompute_num_layers", False)
    return [f"  model.recompute_num_layers = {p.recomputed_layers}{mark[auto]}"] if p.recomputed_layers or auto else []


def format_plan(p: Plan, s: Any = None) -> str:
    """The readable table `bin/train --plan` prints."""
    mark = {True: " (auto)", False: ""}
    lines = [
        f"memory plan: {p.parameters / 1e9:.2f} B parameters, {p.cpu_parameters / 1e9:.2f} B stepped on the CPU",
        f"  optimizer.optimizer_offload_fraction = {p.fraction:.2f}"
        f"{mark[p.auto.get('optimizer.optimizer_offload_fraction', False)]}",
        f"  model.cpu_offloading_num_layers = {p.offloaded_layers}"
        f"{mark[p.auto.get('model.cpu_offloading_num_layers', False)]}",
        *_recompute_line(p, mark),
        f"  activations: {p.layer_activation_bytes / 2**20:.1f} MiB per layer ({p.activations_source}); an offloaded "
        f"layer moves {p.offloaded_layer_bytes / 2**20:.1f} MiB to the host",
    ]
    lines += _offload_lines(p, s)
    lines += _time_lines(p)
    lines.append("")
    lines += _device_block("GPU" if p.gpu.device == "cuda" else "device (CPU)", p.gpu)
    lines.append("")
    lines += _device_block("host", p.host)
    lines += [f"note: {n}" for n in p.notes]
    if not p.batch_seen:
        lines.append("fits: not known (activations not measured at a batch of the model's own; the bytes above "
                     f"{'fit' if p.memory_fits else 'do not fit'} without them): pass example_batch=")  # fmt: skip
    else:
        lines.append(f"fits: {'yes' if p.fits else 'no'}")
    return "\n".join(lines)
