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
             gradients are half (with fp32 accumulation buffers it steps on those directly), or with narrow
             states its bounded fp32 staging slices (engine.optim.gpu_side.gpu_side_bytes says which)
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
from engine.optim.blockwise import NAME as BLOCKWISE
from engine.optim.blockwise import blocks
from engine.optim.delayed import shadow_gpu_bytes
from engine.optim.gpu_assist import assist_gpu_bytes
from engine.optim.gpu_side import gpu_side_bytes
from engine.optim.host_plan import STATE_BYTES, cpu_side_host_bytes
from engine.optim.partition import offload_count
from engine.planning.activations import Saved
from engine.planning.census import Census
from engine.planning.runs import Steps, Suffix, suffix
from engine.planning.step_time import StepTime
from engine.precision import fp8_weight_cache_bytes

GIB = 1 << 30
MIB = 1 << 20
GPU_MARGIN_FIXED = GIB  # CUDA context, cuBLAS workspaces, NCCL: outside torch's caching allocator
GPU_MARGIN_FRACTION = 0.05  # the caching allocator's rounding and fragmentation
HOST_RUNTIME_CUDA = 3 * GIB // 2  # python, torch, the CUDA libraries and the driver's host side: 1.2 GiB of
# peak RSS measured on the H200 for a process that trains a model with nothing offloaded (docs/BENCHMARKS.md)
HOST_RUNTIME_CPU = GIB // 2
HOST_MARGIN_FRACTION = 0.02  # malloc and page rounding

# what the plan knows of TE's FP8 (engine/precision.py; TE 2.20 on Hopper, read from its code)
FP8_NOTE = (
    "train.fp8: each layer's saved activations counted as in bf16, an upper bound (TE saves some GEMM inputs "
    "in FP8); the FP8 copies of the layer weights with their transposes counted in fp8_weight_cache"
)

GPU_PARTS = ("weights", "gradients", "master_weights", "optimizer_states", "activations", "activations_outside_layers",
             "activation_offload_buffers", "logits_and_loss", "backward_working", "optimizer_step_staging",
             "gpu_assist_slots", "ddp_buckets", "delayed_update_shadow", "fp8_weight_cache")  # fmt: skip


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
    moment_bytes: tuple[int, int]  # optimizer.exp_avg_dtype, exp_avg_sq_dtype (both parts)
    moment_coded: tuple[bool, bool]  # those held as block-wise 8-bit codes ("int8_blockwise": scales on top)
    remainders: bool  # optimizer.store_param_remainders: the master as bf16 weight + remainder (both parts)
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
    fp8: bool = False  # train.fp8: TE layers keep FP8 copies of their weights (precision.fp8_weight_cache_bytes)


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
        moment_coded=(o.exp_avg_dtype == BLOCKWISE, o.exp_avg_sq_dtype == BLOCKWISE),
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
        fp8=t.fp8 is not None,
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
    step_time: StepTime | None = None  # the predicted step (engine.planning.pricing), when priced
    costs: str = ""  # the rates it was priced with, and where each comes from (one line: Costs.describe)
    rates: dict[str, Any] = field(default_factory=dict)  # the same as JSON (Costs.to_json)
    next_best: tuple[tuple[float, int, int, StepTime], ...] = ()  # "auto": (fraction, k, r, time) of the runners-up

    @property
    def fits(self) -> bool:
        """Both devices fit; never claimed for a model whose activations were not measured at its batch."""
        return self.batch_seen and self.memory_fits

    @property
    def memory_fits(self) -> bool:
        """The bytes counted fit both budgets (without a batch: weights and optimizer only, a lower bound)."""
        return self.gpu.fits and self.host.fits

    def choice(self) -> dict[str, Any]:
        """The mix this plan is of and its predicted step, as a run's metrics record it once at the start."""
        return {"fraction": self.fraction, "offloaded_layers": self.offloaded_layers,
                "recomputed_layers": self.recomputed_layers,
                "predicted_step_ms": None if self.step_time is None else round(1000 * self.step_time.total_s, 1),
                "auto": sorted(k for k, a in self.auto.items() if a), "costs": self.costs}  # fmt: skip

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
            **({} if self.step_time is None else {"predicted_step": {**self.step_time.to_json(), "costs": self.costs,
                                                                   "rates": dict(self.rates)},
                                                  "next_candidates": [_candidate(*c) for c in self.next_best]}),
            **({} if self.batch_seen else {"batch_seen": False}),
        }  # fmt: skip


def _candidate(fraction: float, k: int, r: int, t: StepTime) -> dict[str, Any]:
    return {"fraction": fraction, "offloaded_layers": k, "recomputed_layers": r, "total_ms": round(1000 * t.total_s, 3)}


def _selected(owners: tuple[tuple[str, str], ...], selectors: tuple[str, ...]) -> bool:
    return any(path in selectors or cls in selectors for path, cls in owners)


def _moves(s: Settings, offloaded: bool, e: Saved) -> bool:
    """Whether storage e of a layer (`offloaded`: one of the first k) lives on the host between forward and
    backward."""
    if e.nbytes <= s.min_bytes:
        return False
    if offloaded:
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
    recomputed after them (None: as the config says; ignored without model.recompute_granularity="full").
    Layers of one shape are counted together (engine.planning.runs): the cost follows the number of distinct
    layers, not the depth."""
    k = k if s.layer_offload else 0
    r = recomputed_count(c, s, k, r)
    fraction = fraction if s.cpu_offload else 0.0
    cpu, n_owned, blocks_owned = _cpu_side(c, s, fraction)
    n_cpu = cpu.numel
    n_gpu_side = n_owned - n_cpu
    gpu_blocks = blocks_owned - sum(b * r for b, (_, r) in zip(cpu.unit_blocks, cpu.units, strict=True))

    g_final = 4 if s.main_grads else s.weight_elem
    g_acc = 4 if s.main_grads else (s.weight_elem if s.micro_batches > 1 else 0)
    gpu_side = gpu_side_bytes(n_gpu_side, kind=s.kind, momentum=s.momentum, half_weights=s.half,
                              main_grads=s.main_grads, moment_bytes=s.moment_bytes,
                              remainders=s.remainders, coded=s.moment_coded, blocks=gpu_blocks)  # fmt: skip
    persistent = {
        "weights": c.weight_bytes,
        "master_weights": gpu_side["master_weights"],
        "optimizer_states": gpu_side["optimizer_states"],
        "gpu_assist_slots": assist_gpu_bytes(cpu.largest, g_final) if s.gpu_assist and cpu.units else 0,
        "ddp_buckets": c.parameters * g_final if s.world > 1 else 0,
        "delayed_update_shadow": shadow_gpu_bytes(n_cpu, s.weight_elem) if s.delayed else 0,
        "fp8_weight_cache": fp8_weight_cache_bytes(sum((b - a) * n for a, b, n in c.layer_pieces)) if s.fp8 else 0,
    }
    acts = c.activations
    lay = _layer_activations(c, s, k, r, cuda)
    head = sum(e.nbytes for e in acts.head)
    head_kept = sum(e.nbytes for e in acts.head if e.what in ("tokens", "positions"))

    # gradient bytes: g_acc per element before its last-micro-batch gradient exists, then g_final (a
    # CPU-stepped one: 0 once shipped with overlap on, else g_final until the step)
    g_cpu = 0 if s.overlap else g_final
    grads_before = g_acc * c.parameters
    grads_after = grads_before + (g_final - g_acc) * (c.parameters - n_cpu) + (g_cpu - g_acc) * n_cpu
    # per layer: what its gradients add once they exist (layer i's appear during its backward)
    delta = Steps(c.n_layers, [(a, b, (g_final - g_acc) * n) for a, b, n in c.layer_pieces]
                  + [(a, b, (g_cpu - g_final) * n) for a, b, n in cpu.by_layer])  # fmt: skip
    out_all, out_cpu = c.side_numel["output"], cpu.by_side.get("output", 0)
    grads_output = (g_final - g_acc) * (out_all - out_cpu) + (g_cpu - g_acc) * out_cpu  # its backward comes first

    phases: dict[str, dict[str, int]] = {}
    phases["forward"] = {**persistent, "gradients": grads_before, "activations": lay.dev.total,
                         "activations_outside_layers": head,
                         "activation_offload_buffers": min(lay.n_moving, 2) * lay.largest_moved,
                         "logits_and_loss": acts.logits_transient}  # fmt: skip
    rebuilt = acts.recompute_working or (acts.layer_bytes(k) if r else 0)  # one recomputed layer, rebuilt
    base = {**persistent, "activations_outside_layers": head_kept,
            "backward_working": acts.backward_working + (rebuilt if r else 0)}  # fmt: skip
    worst = _worst_backward(c.n_layers, s, k, lay, delta, grads_before + grads_output, base)
    if worst is not None:
        phases["backward"] = worst
    phases["step"] = {**persistent, "gradients": grads_after,
                      "optimizer_step_staging": gpu_side["optimizer_step_staging"]}  # fmt: skip
    gpu_phase = max(phases, key=lambda p: sum(phases[p].values()))
    gpu_parts = {name: phases[gpu_phase].get(name, 0) for name in GPU_PARTS}
    if cuda:
        gpu_parts["allocator_margin"] = GPU_MARGIN_FIXED + int(GPU_MARGIN_FRACTION * sum(gpu_parts.values()))
    gpu = DevicePlan("cuda" if cuda else "cpu", gpu_parts, gpu_phase,
                     {p: sum(v.values()) for p, v in phases.items()}, gpu_budget if cuda else None)  # fmt: skip

    host = _host_plan(c, s, cpu, g_final, lay.pool, cuda, gpu, host_budget, n_owned)
    layer0 = acts.layer_bytes(0) if acts.layers else 0
    notes = list(c.notes)
    if s.world > 1:
        notes.append(f"planned for the rank holding the most optimizer state of {s.world}")
    if s.fp8:
        notes.append(FP8_NOTE)
    return Plan(gpu=gpu, host=host, fraction=fraction, offloaded_layers=k, parameters=c.parameters,
                cpu_parameters=n_cpu, layer_activation_bytes=layer0,
                offloaded_layer_bytes=sum(e.nbytes for e in acts.layers[0] if _moves(s, s.layer_offload, e))
                if acts.layers else 0, activations_source=acts.source,
                notes=tuple(notes), batch_seen=c.batch_seen, recomputed_layers=r)  # fmt: skip


def _cpu_side(c: Census, s: Settings, fraction: float) -> tuple[Suffix, int, int]:
    """(the CPU-stepped parameters, the elements the planned rank owns, their block-wise 8-bit blocks) at
    `fraction`: the split of engine.optim.partition over the rank's parameters (all of them without the
    distributed optimizer)."""
    key = ("cpu", fraction, s.world if s.distributed else 1)
    if key not in c.split_cache:  # "auto" asks for the same fraction at many layer counts
        runs = c.owned_runs(s.world) if s.distributed else c.runs
        taken = offload_count([(r.numels, r.count) for r in runs], fraction) if fraction > 0 else 0
        c.split_cache[key] = (suffix(runs, taken), sum(r.size * r.count for r in runs),
                              sum(r.count * sum(map(blocks, r.numels)) for r in runs))  # fmt: skip
    return c.split_cache[key]


@dataclass(frozen=True)
class _Layers:
    """Saved activations per layer: on the device (`dev`) and moved to the host (`moved`, per layer)."""

    dev: Steps
    moved: Steps
    n_moving: int  # layers that move anything
    largest_moved: int  # the most one layer moves
    slabs: int  # the double buffer's two slabs
    pool: int  # the host pool of every moved stash


def _layer_activations(c: Census, s: Settings, k: int, r: int, cuda: bool) -> _Layers:
    """Each run of layers that save the same storages, split where offloading (< k) and recompute (k..k+r-1)
    change what they keep."""
    acts = c.activations
    dev, moved, groups = [], [], {}
    pool = n_moving = largest = 0
    for a, b, entries in c.activation_runs:
        for lo, hi in ((a, min(b, k)), (max(a, k), min(b, k + r)), (max(a, k + r), b)):
            if lo >= hi:
                continue
            kept = entries
            if k <= lo < k + r:  # a recomputed layer keeps what its checkpoint keeps
                first = next((e for e in entries if not e.weight_copy), None)
                kept = list(acts.checkpointed) if acts.checkpointed is not None else [first] * bool(first)
            offloaded = s.layer_offload and lo < k
            stashes = [e.nbytes for e in kept if _moves(s, offloaded, e)]
            dev.append((lo, hi, sum(e.nbytes for e in kept if not _moves(s, offloaded, e))))
            moved.append((lo, hi, sum(stashes)))
            groups[tuple(stashes)] = stashes
            pool += (hi - lo) * sum(host_buffer_bytes(x, cuda) for x in stashes)
            if stashes and sum(stashes):
                n_moving += hi - lo
                largest = max(largest, sum(stashes))
    return _Layers(Steps(c.n_layers, dev), Steps(c.n_layers, moved), n_moving, largest,
                   double_buffer_bytes(list(groups.values())), pool)  # fmt: skip


def _worst_backward(n: int, s: Settings, k: int, lay: _Layers, delta: Steps, grads_start: int,
                    base: dict[str, int]) -> dict[str, int] | None:  # fmt: skip
    """The backward phase at its worst layer (ties: the later layer, the first backward reaches).

    At layer i: the gradients of every layer from i up, the activations of layers 0..i, the reloads. Between
    the points where a per-layer figure changes (and the reload window's edges) the total is linear in i, so
    its maximum is at one of those points: only they are evaluated."""
    lookahead = reload_lookahead(n, k, double_buffering=s.double_buffering, fine_grained=bool(s.fine_grained))
    first_moving = next((a for a, _, v in lay.moved.pieces() if v), None)
    kinks = {0, n, *lay.dev.starts, *lay.moved.starts, *delta.starts}
    points = {i + d for q in kinks for i in (q, q + lookahead) for d in (-1, 0, 1)}
    worst: dict[str, int] | None = None
    for i in sorted((i for i in points if 0 <= i < n), reverse=True):
        if s.double_buffering:
            reload = lay.slabs if first_moving is not None and first_moving <= i else 0
        else:
            reload = lay.moved.prefix(i + 1) - lay.moved.prefix(max(0, i - lookahead))
        ph = {**base, "gradients": grads_start + delta.total - delta.prefix(i), "activations": lay.dev.prefix(i + 1),
              "activation_offload_buffers": reload}  # fmt: skip
        if worst is None or sum(ph.values()) > sum(worst.values()):
            worst = ph
    return worst


def _host_plan(c: Census, s: Settings, cpu: Suffix, g_final: int, pool: int, cuda: bool, gpu: DevicePlan,
               budget: int | None, n_owned: int) -> DevicePlan:  # fmt: skip
    optimizer = {}
    if cpu.units:
        optimizer = cpu_side_host_bytes([n for n, _ in cpu.units], kind=s.kind, use_torch=s.use_torch,
                                        half_bytes=2 if s.half else 0, grad_bytes=g_final,
                                        speculate=s.overlap and not s.delayed,
                                        speculation_buffer_bytes=s.speculation_bytes,
                                        exp_avg_bytes=s.moment_bytes[0], exp_avg_sq_bytes=s.moment_bytes[1],
                                        remainders=s.remainders, repeats=[x for _, x in cpu.units],
                                        coded=s.moment_coded, unit_blocks=cpu.unit_blocks)  # fmt: skip
    base = {"runtime": HOST_RUNTIME_CUDA if cuda else HOST_RUNTIME_CPU, "data": s.data_bytes}
    training = {**base, **{f"optimizer.{k}": v for k, v in optimizer.items()},
                "activation_pool": pool}  # fmt: skip
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
