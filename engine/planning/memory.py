"""The memory plan's arithmetic: bytes per device, by part and by phase of a training step, for one offload
fraction and one number of offloaded layers. Pure: a census and numbers in, integers out, nothing allocated.

GPU phases (each the sum of what is alive at that moment; the plan is their maximum):
  forward    the end of the last micro-batch's forward, as its backward starts: weights, the GPU side's fp32
             masters and optimizer states, gradients accumulated over the earlier micro-batches, every layer's
             saved activations (an offloaded layer keeps only what stays on the device), what is saved outside
             the layers, the logits/loss transient, and up to two offloaded layers whose copies may still run
  backward   the worst layer of the last backward: activations not yet used, reloaded offloaded layers (the
             double buffer, or the reload window), gradients produced so far (a CPU-stepped gradient leaves
             the GPU once its D2H copy has read it when overlap is on, and at the step otherwise), one layer's
             backward temporaries (plus one rebuilt layer under full recompute)
  step       every final gradient, plus the fp32 copies the GPU side's torch optimizer steps on when the
             gradients are half (with fp32 accumulation buffers it steps on those directly)
  margin     1 GiB (CUDA context, cuBLAS workspaces: outside torch's allocator) + 5% (the caching allocator)

Host phases: construction (a given model's host bytes before it moves; the built-in GPT is built on the meta
device and allocated on the training device in its final dtype, engine/models/init.py, so it adds none),
training (the CPU side's parts from engine.optim.host_plan, the pinned activation pool, the runtime, the data),
checkpoint (training plus the optimizer's state dict copied to the host).
On a CPU run the device is the host: the device plan's peak is a host part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config import Config
from engine.offload.api import DEFAULT_MIN_BYTES, reload_lookahead
from engine.offload.pool import host_buffer_bytes
from engine.offload.session import double_buffer_bytes
from engine.optim.delayed import shadow_gpu_bytes
from engine.optim.distributed import partition
from engine.optim.gpu_assist import assist_gpu_bytes
from engine.optim.host_plan import STATE_BYTES, cpu_side_host_bytes
from engine.optim.partition import split_for_offload
from engine.planning.activations import Saved
from engine.planning.census import Census

GIB = 1 << 30
MIB = 1 << 20
GPU_MARGIN_FIXED = GIB  # CUDA context, cuBLAS workspaces, NCCL: outside torch's caching allocator
GPU_MARGIN_FRACTION = 0.05  # the caching allocator's rounding and fragmentation
HOST_RUNTIME_CUDA = 3 * GIB // 2  # python, torch, the CUDA libraries and the driver's host side: 1.2 GiB of
# peak RSS measured on the H200 for a process that trains a model with nothing offloaded (docs/BENCHMARKS.md)
HOST_RUNTIME_CPU = GIB // 2
HOST_MARGIN_FRACTION = 0.02  # malloc and page rounding

GPU_PARTS = ("weights", "gradients", "master_weights", "optimizer_states", "activations", "activations_outside_layers",
             "activation_offload_buffers", "logits_and_loss", "backward_working", "optimizer_step_staging",
             "gpu_assist_slots", "ddp_buckets", "delayed_update_shadow")  # fmt: skip


@dataclass(frozen=True)
class Settings:
    """What the plan reads from a config, as numbers."""

    micro_batches: int
    half: bool
    weight_elem: int
    kind: str
    momentum: bool
    cpu_offload: bool
    overlap: bool
    main_grads: bool  # fp32 sums of half gradients over micro-batches (accumulate_allreduce_grads_in_fp32)
    use_torch: bool
    gpu_assist: bool
    speculation_bytes: int
    moment_bytes: tuple[int, int]  # optimizer.exp_avg_dtype, exp_avg_sq_dtype on the CPU-stepped part
    remainders: bool  # optimizer.store_param_remainders: the CPU-stepped master as bf16 weight + remainder
    delayed: bool  # optimizer.delayed_param_update: a GPU shadow of the CPU-stepped weights, no speculation
    distributed: bool
    layer_offload: bool
    offload_activations: bool
    offload_weights: bool
    double_buffering: bool
    fine_grained: tuple[str, ...]
    min_bytes: int
    checkpoint_save: bool
    recompute: bool  # model.recompute_granularity="full"
    recompute_num_layers: int | str | None  # how many layers recompute after the offloaded ones (None: every one)
    data_bytes: int
    world: int


def settings_of(cfg: Config, world: int = 1) -> Settings:
    t, o, m = cfg.train, cfg.optimizer, cfg.model
    half = t.params_dtype == "half"
    micro = max(1, t.global_batch_size // (t.micro_batch_size * world))
    return Settings(
        micro_batches=micro,
        half=half,
        weight_elem=2 if half else 4,
        kind=o.optimizer,
        momentum=o.sgd_momentum > 0,
        cpu_offload=o.optimizer_cpu_offload,
        overlap=o.optimizer_cpu_offload and o.overlap_cpu_optimizer_d2h_h2d,
        main_grads=half and o.accumulate_allreduce_grads_in_fp32 and micro > 1,
        use_torch=o.optimizer_cpu_offload and o.use_torch_optimizer_for_cpu_offload,
        gpu_assist=o.cpu_offload_gpu_assist,
        speculation_bytes=o.speculation_buffer_mb * MIB,
        moment_bytes=(STATE_BYTES[o.exp_avg_dtype], STATE_BYTES[o.exp_avg_sq_dtype]),
        remainders=o.store_param_remainders,
        delayed=o.optimizer_cpu_offload and o.delayed_param_update,
        distributed=o.use_distributed_optimizer and world > 1,
        layer_offload=m.cpu_offloading,
        offload_activations=m.cpu_offloading_activations,
        offload_weights=m.cpu_offloading_weights,
        double_buffering=m.cpu_offloading_double_buffering,
        fine_grained=tuple(m.offload_modules) if m.fine_grained_activation_offloading else (),
        min_bytes=DEFAULT_MIN_BYTES,
        checkpoint_save=cfg.checkpoint.save is not None,
        recompute=m.recompute_granularity == "full",
        recompute_num_layers=m.recompute_num_layers,
        data_bytes=2 * cfg.data.max_bytes if cfg.data.source != "tokens" else 0,  # the joined bytes and their array
        world=world,
    )


@dataclass(frozen=True)
class DevicePlan:
    """One device's plan: `parts` are the peak phase's and sum to `total_bytes`."""

    device: str
    parts: dict[str, int]
    phase: str
    phases: dict[str, int]
    budget_bytes: int | None

    @property
    def total_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.total_bytes <= self.budget_bytes

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "total_bytes": self.total_bytes, "budget_bytes": self.budget_bytes,
                "fits": self.fits, "peak_phase": self.phase, "phases": dict(self.phases),
                "parts": dict(self.parts)}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """The bytes each device will hold (see engine.planning)."""

    gpu: DevicePlan  # the training device: CUDA, or the CPU itself (then budget None: its bytes are a host part)
    host: DevicePlan
    fraction: float  # optimizer.optimizer_offload_fraction as resolved (0 without optimizer offload)
    offloaded_layers: int  # model.cpu_offloading_num_layers as resolved (0 without layer offload)
    parameters: int
    cpu_parameters: int
    layer_activation_bytes: int  # one layer's saved activations (the first layer)
    offloaded_layer_bytes: int  # of those, what an offloaded layer moves to the host
    activations_source: str
    auto: dict[str, bool] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    batch_seen: bool = True  # False: a user's model whose activations were not measured at a batch of its own
    recomputed_layers: int = 0  # full recompute: layers offloaded_layers .. + recomputed_layers - 1

    @property
    def fits(self) -> bool:
        """Both devices fit; never claimed for a model whose activations were not measured at its batch."""
        return self.batch_seen and self.memory_fits

    @property
    def memory_fits(self) -> bool:
        """The bytes counted fit both budgets (without a batch: weights and optimizer only, a lower bound)."""
        return self.gpu.fits and self.host.fits

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits if self.batch_seen else None,
            "fraction": self.fraction, "offloaded_layers": self.offloaded_layers,
            "recomputed_layers": self.recomputed_layers,
            "auto": dict(self.auto), "parameters": self.parameters, "cpu_stepped_parameters": self.cpu_parameters,
            "gpu": self.gpu.to_json(), "host": self.host.to_json(),
            "activations": {"source": self.activations_source, "per_layer_bytes": self.layer_activation_bytes,
                            "offloaded_per_layer_bytes": self.offloaded_layer_bytes},
            "notes": list(self.notes),
            **({} if self.batch_seen else {"batch_seen": False}),
        }  # fmt: skip


def _selected(owners: tuple[tuple[str, str], ...], selectors: tuple[str, ...]) -> bool:
    return any(path in selectors or cls in selectors for path, cls in owners)


def _moves(s: Settings, layer: int, k: int, e: Saved) -> bool:
    """Whether storage e of `layer` lives on the host between forward and backward."""
    if e.nbytes <= s.min_bytes:
        return False
    if s.layer_offload and layer < k:
        return s.offload_weights if e.weight_copy else s.offload_activations
    return bool(s.fine_grained) and not e.weight_copy and _selected(e.owners, s.fine_grained)


def recomputed_count(c: Census, s: Settings, k: int, r: int | None = None) -> int:
    """How many layers full recompute takes: r (a candidate of "auto"), else the config's count (None: all)."""
    if not s.recompute:
        return 0
    if r is None:
        r = s.recompute_num_layers if isinstance(s.recompute_num_layers, int) else None
        if r is None and s.recompute_num_layers == "auto":
            r = 0
    return c.n_layers if r is None else max(0, min(r, c.n_layers - k))


def evaluate(c: Census, s: Settings, fraction: float, k: int, *, cuda: bool, gpu_budget: int | None,
             host_budget: int | None, r: int | None = None) -> Plan:  # fmt: skip
    """The plan at one offload fraction, k offloaded layers (ignored without model.cpu_offloading) and r layers
    recomputed after them (None: as the config says; ignored without model.recompute_granularity="full")."""
    k = k if s.layer_offload else 0
    r = recomputed_count(c, s, k, r)
    fraction = fraction if s.cpu_offload else 0.0
    named = c.named
    owned = named
    if s.distributed:  # the rank owning the most elements (engine.optim.distributed's partition)
        owners = partition([p.n for _, p in named], s.world)
        loads = [sum(p.n for (_, p), o in zip(named, owners, strict=True) if o == r) for r in range(s.world)]
        busiest = max(range(s.world), key=lambda r: loads[r])
        owned = [(n, p) for (n, p), o in zip(named, owners, strict=True) if o == busiest]
    key = (fraction, len(owned))
    if key not in c.split_cache:  # "auto" asks for the same fraction at many layer counts
        c.split_cache[key] = frozenset(split_for_offload(owned, fraction)) if fraction > 0 else frozenset()
    cpu_names = c.split_cache[key]
    numel = c.numels
    if ("n", key) not in c.split_cache:
        c.split_cache[("n", key)] = sum(numel[n] for n in cpu_names)
    n_cpu = c.split_cache[("n", key)]
    n_gpu_side = (c.parameters if owned is named else sum(p.n for _, p in owned)) - n_cpu

    g_final = 4 if s.main_grads else s.weight_elem
    g_acc = 4 if s.main_grads else (s.weight_elem if s.micro_batches > 1 else 0)
    states = {"adam": 8, "sgd": 4 if s.momentum else 0}[s.kind]
    persistent = {
        "weights": c.weight_bytes,
        "master_weights": 4 * n_gpu_side if s.half else 0,
        "optimizer_states": states * n_gpu_side,
        "gpu_assist_slots": 0,
        "ddp_buckets": c.parameters * g_final if s.world > 1 else 0,
        "delayed_update_shadow": shadow_gpu_bytes(n_cpu, s.weight_elem) if s.delayed else 0,
    }
    if s.gpu_assist and cpu_names:
        largest = max(numel[n] for n in cpu_names)
        persistent["gpu_assist_slots"] = assist_gpu_bytes(largest, g_final)

    # activations, layer by layer: what stays on the device, what moves (its stash sizes)
    acts = c.activations
    dev, moved = [], []
    seen: dict[tuple[int, bool], tuple[int, list[int]]] = {}  # layers usually share one list of storages
    kept: dict[int, list] = {}  # a recomputed layer's storages: what its checkpoint keeps
    for i, entries in enumerate(acts.layers):
        if k <= i < k + r:
            if id(entries) not in kept:
                first = next((e for e in entries if not e.weight_copy), None)
                kept[id(entries)] = list(acts.checkpointed) if acts.checkpointed is not None else [first] * bool(first)
            entries = kept[id(entries)]
        key = (id(entries), s.layer_offload and i < k)
        if key not in seen:
            seen[key] = (sum(e.nbytes for e in entries if not _moves(s, i, k, e)),
                         [e.nbytes for e in entries if _moves(s, i, k, e)])  # fmt: skip
        dev.append(seen[key][0])
        moved.append(seen[key][1])
    moved_total = [sum(x) for x in moved]
    slabs = double_buffer_bytes(list({id(m): m for m in moved}.values()))  # layers share their lists
    n_moving = sum(1 for x in moved_total if x)
    head = sum(e.nbytes for e in acts.head)
    head_kept = sum(e.nbytes for e in acts.head if e.what in ("tokens", "positions"))

    # gradient bytes: g_acc per element before its last-micro-batch gradient exists, then g_final (a
    # CPU-stepped one: 0 once shipped with overlap on, else g_final until the step)
    g_cpu = 0 if s.overlap else g_final
    cpu_by_group: dict[int | str, int] = {}
    for n in cpu_names:
        g = c.group_of[n]
        cpu_by_group[g] = cpu_by_group.get(g, 0) + numel[n]

    def added(group: int | str) -> int:
        """Bytes a group's gradients add once its backward has run (layer index, "output" or "input")."""
        n_all, n_c = c.group_numel.get(group, 0), cpu_by_group.get(group, 0)
        return (g_final - g_acc) * (n_all - n_c) + (g_cpu - g_acc) * n_c

    grads_before = g_acc * c.parameters
    grads_after = grads_before + sum(added(g) for g in c.group_numel)

    phases: dict[str, dict[str, int]] = {}
    phases["forward"] = {**persistent, "gradients": grads_before, "activations": sum(dev),
                         "activations_outside_layers": head,
                         "activation_offload_buffers": min(n_moving, 2) * max(moved_total, default=0),
                         "logits_and_loss": acts.logits_transient}  # fmt: skip
    # backward, layer by layer from the last: names of the output side are done first, the input side's last
    delta = [added(i) for i in range(c.n_layers)]  # per layer: what its gradients add once they exist
    grads_now = grads_before + added("output")  # the output side's backward comes first
    lookahead = reload_lookahead(c.n_layers, k, double_buffering=s.double_buffering, fine_grained=bool(s.fine_grained))
    dev_below = [0] * (c.n_layers + 1)
    for i, d in enumerate(dev):
        dev_below[i + 1] = dev_below[i] + d
    worst: dict[str, int] | None = None
    rebuilt = acts.recompute_working or (acts.layer_bytes(k) if r else 0)  # one recomputed layer, rebuilt
    for i in reversed(range(c.n_layers)):
        grads_now += delta[i]  # layer i's weight gradients appear during its backward
        if s.double_buffering:
            reload = slabs if any(moved_total[: i + 1]) else 0
        else:
            reload = sum(moved_total[max(0, i - lookahead) : i + 1])
        ph = {**persistent, "gradients": grads_now, "activations": dev_below[i + 1],
              "activations_outside_layers": head_kept, "activation_offload_buffers": reload,
              "backward_working": acts.backward_working + (rebuilt if r else 0)}  # fmt: skip
        if worst is None or sum(ph.values()) > sum(worst.values()):
            worst = ph
    if worst is not None:
        phases["backward"] = worst
    phases["step"] = {**persistent, "gradients": grads_after,
                      "optimizer_step_staging": 4 * n_gpu_side if (s.half and not s.main_grads) else 0}  # fmt: skip
    gpu_phase = max(phases, key=lambda p: sum(phases[p].values()))
    gpu_parts = {name: phases[gpu_phase].get(name, 0) for name in GPU_PARTS}
    if cuda:
        gpu_parts["allocator_margin"] = GPU_MARGIN_FIXED + int(GPU_MARGIN_FRACTION * sum(gpu_parts.values()))
    gpu = DevicePlan("cuda" if cuda else "cpu", gpu_parts, gpu_phase,
                     {p: sum(v.values()) for p, v in phases.items()}, gpu_budget if cuda else None)  # fmt: skip

    host = _host_plan(c, s, cpu_names, named, g_final, moved, cuda, gpu, host_budget, n_cpu + n_gpu_side)
    layer0 = acts.layer_bytes(0) if acts.layers else 0
    notes = list(c.notes)
    if s.world > 1:
        notes.append(f"planned for the rank holding the most optimizer state of {s.world}")
    return Plan(gpu=gpu, host=host, fraction=fraction, offloaded_layers=k, parameters=c.parameters,
                cpu_parameters=n_cpu, layer_activation_bytes=layer0,
                offloaded_layer_bytes=sum(e.nbytes for e in acts.layers[0] if _moves(s, 0, max(k, 1), e))
                if acts.layers else 0, activations_source=acts.source,
                notes=tuple(notes), batch_seen=c.batch_seen, recomputed_layers=r)  # fmt: skip


def _host_plan(c: Census, s: Settings, cpu_names: set[str], named, g_final: int, moved: list[list[int]],
               cuda: bool, gpu: DevicePlan, budget: int | None, n_owned: int) -> DevicePlan:  # fmt: skip
    units: dict[str, int] = {}
    for n in sorted(cpu_names, key=c.position.__getitem__):  # forward order, so the units are too
        units[c.unit[n]] = units.get(c.unit[n], 0) + c.numels[n]
    optimizer = {}
    if cpu_names:
        optimizer = cpu_side_host_bytes(list(units.values()), kind=s.kind, use_torch=s.use_torch,
                                        half_bytes=2 if s.half else 0, grad_bytes=g_final,
                                        speculate=s.overlap and not s.delayed,
                                        speculation_buffer_bytes=s.speculation_bytes,
                                        exp_avg_bytes=s.moment_bytes[0],
                                        exp_avg_sq_bytes=s.moment_bytes[1], remainders=s.remainders)  # fmt: skip
    base = {"runtime": HOST_RUNTIME_CUDA if cuda else HOST_RUNTIME_CPU, "data": s.data_bytes}
    training = {**base, **{f"optimizer.{k}": v for k, v in optimizer.items()},
                "activation_pool": sum(host_buffer_bytes(x, cuda) for m in moved for x in m)}  # fmt: skip
    if not cuda:
        training["device_memory"] = gpu.total_bytes  # a CPU run: the "device" is this host
    # construction: the built-in GPT is allocated on the device in its final dtype (engine.build), so the host
    # holds none of it on a CUDA run, and on a CPU run its weights are the device part of training
    built = 0 if c.builtin else c.host_model_bytes
    phases = {"construction": {**base, "model_construction": built}, "training": training}
    if s.checkpoint_save:  # the optimizer's state dict: fp32 master and states of every parameter, on the host
        per = 4 + {"adam": 8, "sgd": 4 if s.momentum else 0}[s.kind]
        phases["checkpoint"] = {**training, "checkpoint_state_copy": per * n_owned}
    peak = max(phases, key=lambda p: sum(phases[p].values()))
    names = list(dict.fromkeys(n for ph in phases.values() for n in ph))
    parts = {n: phases[peak].get(n, 0) for n in names}
    parts["margin"] = int(HOST_MARGIN_FRACTION * sum(parts.values()))
    return DevicePlan("host", parts, peak, {p: sum(v.values()) for p, v in phases.items()}, budget)
