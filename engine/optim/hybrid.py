"""HybridDeviceOptimizer: a fraction of the parameters stepped on the CPU, overlapped with GPU work.

Composition (each mechanism in its own module):
  partition.py   which parameters the CPU steps (the output end) and their layer units
  gpu_side.py    the rest: fp32 masters and a fused torch optimizer on the GPU (gpu_narrow.py with narrow
                 states: the precision-aware optimizer's moments and remainder master, on both sides)
  cpu_side.py    the CPU part's step scheduler (driver thread, speculation, commit), built from
                 host_state.py (host tensors: masters, states, spares, staging), cpu_arith.py (the CPU
                 AdamW pass / torch.optim) and cpu_transfer.py (gradient D2H, weight H2D, events);
                 host_plan.py predicts its host bytes without allocating
  gpu_assist.py  optional (gpu_assist=True): the GPU steps some host-resident units alongside the CPU
This module owns the bookkeeping between them: gradient accumulation (fp32 where asked),
the global gradient norm and clipping, LR and hyperparameters from `param_groups`, and the
device- and fraction-independent state dict.

Timeline of one step with overlap on:
  backward      each CPU-stepped gradient, once final, has its norm taken on the GPU and starts
                its D2H copy from a backward hook; GPU-stepped gradients stay where they are
  clip_and_step the one synchronisation: the global norm (all parameters) comes to the host, since
                clipping and the finite check need it before any update; then the CPU step is
                handed to the driver thread, and the GPU step runs, with no host wait after it
  next forward  each layer unit's pre-hook makes the compute stream wait for that unit's H2D
                event, so the GPU waits only when it reaches a layer the CPU has not finished

GPU memory beyond the model and the GPU-stepped part's masters and states: a CPU-stepped gradient
lives on the GPU only until its D2H copy has read it (its memory is returned then, stream-ordered).
With gradient accumulation over micro-batches and accumulate_grads_in_fp32, the fp32 partial sums
of half-precision gradients stay on the GPU until the last micro-batch, for CPU-stepped parameters
too (4 bytes per parameter, Megatron's main_grad); with one micro-batch there are none.
Model weights of CPU-stepped layers are current only after synchronize() (or their forward):
read model.state_dict() after optimizer.state_dict() or synchronize().
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Iterable

import torch

from engine.optim import blockwise
from engine.optim.adam_math import Hyper
from engine.optim.cpu_side import CpuPart
from engine.optim.delayed import DelayedUpdate
from engine.optim.gpu_narrow import NarrowGpuPart
from engine.optim.gpu_side import GpuPart, gpu_part
from engine.optim.options import HybridOptions, betas, number_in
from engine.optim.partition import forward_order, split_for_offload, unit_of
from engine.optim.protocol import CpuOffload, decide

log = logging.getLogger(__name__)
STATE_FORMAT = "engine.optim.hybrid/1"
_HALF = (torch.bfloat16, torch.float16)


def default_cpu_threads() -> int:
    """All cores this process may run on but one: that one is left to the thread driving transfers.
    (Measured on the device: with all 16 cores stepping while copies ran the step slowed 7.8x.)"""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        import cpuinfo

        n = int(cpuinfo.get_cpu_info().get("count") or os.cpu_count() or 2)
    return max(1, n - 1)


def clear_grads(params: Iterable[torch.Tensor], set_to_none: bool) -> None:
    """torch.optim's zero_grad over `params`: drop each gradient, or zero it in place."""
    for p in params:
        if p.grad is not None:
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()


def _named_groups(params) -> list[dict]:
    """Normalise named_parameters() or groups of (name, p) pairs into groups of named pairs."""
    params = list(params)
    if not params:
        raise ValueError("params is empty: pass model.named_parameters() or param groups")
    groups = params if isinstance(params[0], dict) else [{"params": params}]
    out, i = [], 0
    for g in groups:
        pairs = []
        for item in g["params"]:
            if isinstance(item, tuple):
                pairs.append(item)
            else:  # a bare tensor: name it by position so the state dict still has stable keys
                pairs.append((f"param{i}", item))
            i += 1
        out.append({**g, "params": pairs})
    return out


def _say_dtype_changes(saved: dict, o: HybridOptions) -> None:
    """One line per moment whose saved dtype differs from the one it loads into (both parts hold the configured
    dtypes): widening is exact, narrowing rounds to nearest; the block-wise 8-bit form is dequantised or quantised."""
    for key, dtype in (("exp_avg", o.exp_avg_dtype), ("exp_avg_sq", o.exp_avg_sq_dtype)):
        saved_as = {st[key].dtype for st in saved.values() if torch.is_tensor(st.get(key))}
        for was, now in sorted(((d, dtype) for d in saved_as if d != dtype), key=str):
            if blockwise.CODES in (was, now):  # the block-wise 8-bit form, saved as its codes and block maxima
                how = "dequantised" if was == blockwise.CODES else "quantised to the nearest code"
                was, now = (blockwise.NAME if d == blockwise.CODES else d for d in (was, now))
            else:
                how = "widened (exact)" if now.itemsize > was.itemsize else "narrowed (rounded to nearest)"
            log.warning("optimizer state %s saved as %s is %s to %s on load", key, was, how, now)


def _wait_unit(optimizer: weakref.ref, unit: str, _module: torch.nn.Module, _args: tuple) -> None:
    """A CPU-stepped unit's forward pre-hook, holding its optimizer weakly."""
    opt = optimizer()
    if opt is not None:
        opt._before_forward(unit)


class HybridDeviceOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Iterable, options: HybridOptions) -> None:
        """params: named_parameters() or groups of (name, parameter) pairs; options: validated when made."""
        if not isinstance(options, HybridOptions):
            raise TypeError(f"options must be a HybridOptions, got {type(options).__name__}")
        o = options
        named_groups = _named_groups(params)
        for g in named_groups:  # per-group overrides are validated like the defaults
            for k in ("lr", "weight_decay", "eps"):
                if k in g:
                    number_in(k, g[k], 0.0, None, lo_open=(k == "eps"))
            if "betas" in g:
                betas(g["betas"])
        super().__init__([{**g, "params": [p for _, p in g["params"]]} for g in named_groups], o.defaults())
        self.options = o
        kind = o.optimizer
        self.kind = kind
        self.offload_fraction = o.offload_fraction
        self.overlap = o.overlap_cpu_optimizer_d2h_h2d
        self.accumulate_grads_in_fp32 = o.accumulate_grads_in_fp32
        self.delayed = DelayedUpdate(o.delayed_param_update_warmup) if o.delayed_param_update else None
        self.last_step_delayed = False  # the last step's CPU update lands one step late (metrics record it)
        self.names: list[str] = []
        self.params_by_name: dict[str, torch.nn.Parameter] = {}
        group_of: dict[str, int] = {}
        for gi, g in enumerate(named_groups):
            for n, p in g["params"]:
                if n in self.params_by_name:
                    raise ValueError(f"parameter name {n!r} appears twice in params")
                self.names.append(n)
                self.params_by_name[n] = p
                group_of[n] = gi
        self._group_of = group_of
        self._side_options = dict(kind=kind, use_torch=o.use_torch_optimizer_for_cpu_offload,
                                  pin_grads=o.pin_cpu_grads, pin_params=o.pin_cpu_params,
                                  threads=o.cpu_threads or default_cpu_threads(), gpu_assist=o.gpu_assist,
                                  speculation_buffer_bytes=o.speculation_buffer_mb << 20,
                                  pin_threads=o.pin_cpu_threads,
                                  moment_dtypes=(o.exp_avg_dtype, o.exp_avg_sq_dtype),
                                  remainders=o.store_param_remainders)  # fmt: skip
        self._split: tuple[list[str], frozenset[str]] | None = None  # forward order and CPU names, made once
        self.gpu: GpuPart | NarrowGpuPart | None = None  # both sides are built on first use, after attach_model has
        self.cpu: CpuPart | None = None  # given the model's order, so the split is made once
        self._grad_final = True
        self._main_grads: dict[str, torch.Tensor] = {}  # fp32 sums of half gradients over micro-batches
        self._cpu_norms: dict[str, torch.Tensor] = {}  # per-tensor norms of shipped CPU gradients
        self._attached = False
        self._norm_order = list(self.names)  # attach_model replaces it with the model's parameter order
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._hook(n)) for n, p in
                              self.params_by_name.items()]  # fmt: skip
        self._pre_hooks: list = []

    def _named(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, self.params_by_name[n]) for n in self._partition()[0]]

    def _partition(self) -> tuple[list[str], frozenset[str]]:
        """(names in forward order, names the CPU steps): computed once, at first use, in the model's order
        when attach_model came first (else the order of the params given)."""
        if self._split is None:
            order = forward_order(self._norm_order)
            named = [(n, self.params_by_name[n]) for n in order]
            cpu = split_for_offload(named, self.offload_fraction) if self.offload_fraction > 0 else set()
            self._split = (order, frozenset(cpu))
        return self._split

    @property
    def cpu_names(self) -> frozenset[str]:
        return self._partition()[1]

    def _build(self) -> None:
        if self.gpu is not None:
            return
        named, gi, opts = self._named(), self._group_of, self._side_options
        self.gpu = gpu_part([(n, p, gi[n]) for n, p in named if n not in self.cpu_names], kind=opts["kind"],
                            n_groups=len(self.param_groups), moment_dtypes=opts["moment_dtypes"],
                            remainders=opts["remainders"])  # fmt: skip
        if self.cpu_names:
            entries = [(n, p, gi[n], unit_of(n)) for n, p in named if n in self.cpu_names]
            hypers = lambda: [Hyper.of(g) for g in self.param_groups]  # noqa: E731 - read by the driver thread
            # a delayed step launches once the clip factor is known: nothing to guess during backward
            self.cpu = CpuPart(entries, **opts, speculate=self.overlap and self.delayed is None, hyper_source=hypers)
            if self.delayed is not None:
                self.delayed.bind({n: p for n, p, _, _ in entries})

    # ---------------------------------------------------------------- gradients
    def set_grad_final(self, is_final: bool) -> None:
        """Before each backward: True when this backward completes the gradient (the last micro-batch)."""
        self._grad_final = bool(is_final)

    def _fp32_acc(self, p: torch.Tensor) -> bool:
        return self.accumulate_grads_in_fp32 and p.dtype in _HALF

    def _hook(self, name: str):
        # weakly: a parameter holds its hooks in autograd's C++ side, where the garbage collector cannot see the
        # cycle parameter -> hook -> optimizer -> parameter; a strong reference kept every dropped engine's
        # model and optimizer states (GPU memory) alive for the rest of the process
        this = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            opt = this()
            if opt is not None:
                opt._grad_ready(name, p)

        return hook

    def _grad_ready(self, name: str, p: torch.Tensor) -> None:
        if self._fp32_acc(p) and (not self._grad_final or name in self._main_grads):
            mg = self._main_grads.get(name)
            if mg is None:
                self._main_grads[name] = p.grad.float()
            else:
                mg.add_(p.grad)
            p.grad = None  # the fp32 sum holds it; no half-precision copy kept alongside
        if self._grad_final and self.overlap and name in self.cpu_names:
            self._ship(name)

    def _final_grad(self, name: str) -> torch.Tensor | None:
        g = self._main_grads.get(name)
        return g if g is not None else self.params_by_name[name].grad

    def _ship(self, name: str) -> None:
        self._build()
        g = self._final_grad(name)
        if g is None:
            return
        self._cpu_norms[name] = torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)
        self.cpu.ship(name, g)
        # the GPU copy is no longer needed once the D2H copy has read it (cpu.ship recorded the stream)
        self._main_grads.pop(name, None)
        self.params_by_name[name].grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._main_grads.clear()
        self._cpu_norms.clear()
        if self.cpu is not None:
            self.cpu.discard()
        clear_grads(self.params_by_name.values(), set_to_none)

    # ---------------------------------------------------------------- step
    def clip_and_step(
        self, max_norm: float, grad_scale: float = 1.0, *, finite: torch.Tensor | None = None
    ) -> tuple[float, bool]:
        """Unscale by grad_scale, clip the global L2 norm to max_norm (0: no clipping), step both sides.

        Returns (global unscaled pre-clip gradient norm, stepped); stepped is False, and nothing is
        updated, when any gradient is non-finite or `finite` is False (EngineOptimizer, optim/protocol.py).
        """
        return self.step(max_norm=max_norm, grad_scale=grad_scale, finite=finite)  # through step: LR schedulers

    @torch.no_grad()
    def step(
        self, closure=None, *, max_norm: float = 0.0, grad_scale: float = 1.0, finite: torch.Tensor | None = None
    ) -> tuple[float, bool]:
        """torch.optim's step (no closure): clip_and_step's update, unclipped unless max_norm is given."""
        if closure is not None:
            raise ValueError("HybridDeviceOptimizer.step does not take a closure")
        max_norm = number_in("max_norm", max_norm, 0.0, None)
        grad_scale = number_in("grad_scale", grad_scale, 0.0, None, lo_open=True)
        self._build()
        if self.cpu is not None:
            for n in self.names:
                if n in self.cpu_names and n not in self.cpu.shipped and n not in self._cpu_norms:
                    self._ship(n)  # no overlap (or no hook fired): ship now
        if self.delayed is not None:  # after the last backward: the previous step's delayed update lands
            self.delayed.land(self._wait_cpu_units)
        self.last_step_delayed = False
        gpu_grads = {n: g for n in self.names if n not in self.cpu_names and (g := self._final_grad(n)) is not None}
        norms = []
        for n in self._norm_order:  # the model's order, as clip_grad_norm_(model.parameters()) stacks them
            if n in gpu_grads:
                norms.append(torch.linalg.vector_norm(gpu_grads[n], 2.0, dtype=torch.float32))
            elif n in self._cpu_norms:
                norms.append(self._cpu_norms[n].to(norms[0].device if norms else self._cpu_norms[n].device))
        if not norms:
            return 0.0, False
        dev = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([x.to(dev) for x in norms]), 2.0)
        if grad_scale != 1.0:
            total = total / grad_scale
        # THE synchronisation of the step: clipping and the finite check need the global norm on the
        # host before any update, CPU or GPU. Everything else in the step is stream-ordered.
        total_f, coef, ok = decide(total, max_norm, finite)
        self._cpu_norms.clear()
        if not ok:
            if self.cpu is not None:
                self.cpu.discard()
            self._main_grads.clear()
            return total_f, False
        hypers = [Hyper.of(g) for g in self.param_groups]
        inv_scale = float(torch.tensor(1.0 / grad_scale, dtype=torch.float32)) if grad_scale != 1.0 else 1.0
        delayed = self.delayed is not None and self.delayed.delays()
        if self.cpu is not None:  # first, so the CPU works while the GPU steps
            self.cpu.launch(hypers, inv_scale, coef, dest=self.delayed.targets() if delayed else None)
        self.gpu.step(gpu_grads, hypers, inv_scale, coef)
        self._main_grads.clear()
        if self.delayed is not None:
            self.delayed.finish_step(True, delayed)
            self.last_step_delayed = delayed
        if self.cpu is not None and not delayed and not (self.overlap and self._attached):
            self.cpu.wait_all()  # nothing waits per layer: updated weights must be in place on return
        return total_f, True

    def _wait_cpu_units(self) -> None:
        """Every unit's update written where it goes; the current stream waits for the copies there."""
        for u in self.cpu.units:
            self.cpu.wait_unit(u)

    def _before_forward(self, unit: str) -> None:
        """A CPU-stepped unit's forward pre-hook: wait for its exact update (a delayed one landed already)."""
        if self.delayed is None or not self.delayed.pending:
            self.cpu.wait_unit(unit)

    # ---------------------------------------------------------------- model hooks
    def attach_model(self, model: torch.nn.Module) -> None:
        """Forward pre-hooks on each CPU-stepped layer unit: the forward waits there, per layer, for its update.

        Call it before the first step: the split between CPU and GPU is made once, at first use, in the model's
        parameter order when the model is attached by then (it decides which layers sit at the output end)."""
        model_order = [n for n, _ in model.named_parameters() if n in self.params_by_name]
        self._norm_order = model_order + [n for n in self.names if n not in set(model_order)]
        self._build()
        if self.cpu is None or self._attached:
            self._attached = True
            return
        names = set(model_order)
        missing = sorted(self.cpu_names - names)
        if missing:
            raise ValueError(f"attach_model: the model has no parameters named {missing[:3]}; pass "
                             "model.named_parameters() of this model to the optimizer")  # fmt: skip
        this = weakref.ref(self)  # weakly, as the gradient hooks
        for unit in self.cpu.units:
            module = model.get_submodule(unit) if unit else model
            self._pre_hooks.append(module.register_forward_pre_hook(functools.partial(_wait_unit, this, unit)))
        self._attached = True

    def _close_sides(self) -> None:
        if self.cpu is not None:
            self.cpu.close()
        self.gpu, self.cpu = None, None

    def close(self) -> None:
        """Finish pending work, remove the hooks on the model and stop the worker threads (the hooks hold this
        optimizer weakly: dropped without close(), it is freed with its engine, its threads ending then)."""
        self.synchronize()
        for h in self._hook_handles + self._pre_hooks:
            h.remove()
        self._hook_handles, self._pre_hooks, self._attached = [], [], False
        self._close_sides()

    def synchronize(self) -> None:
        """Wait until every update is in the model's weights (before reading them outside a forward); a delayed
        update (delayed_param_update) is complete in the masters then and lands in the weights in the next step."""
        if self.cpu is not None:
            self.cpu.wait_all()

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Full fp32 master weights and optimizer states by parameter name, on the host; the same for any fraction."""
        self._build()
        self.synchronize()
        state, ahead = {}, self._masters_ahead()
        for n in self.names:
            state[n] = self.cpu.export(n, ahead.get(n)) if n in self.cpu_names else self.gpu.export(n)
        groups = []
        for g in self.param_groups:
            gd = {k: v for k, v in g.items() if k != "params"}
            gd["params"] = [n for n in self.names if any(self.params_by_name[n] is p for p in g["params"])]
            groups.append(gd)
        out = {"format": STATE_FORMAT, "optimizer": self.kind, "state": state, "param_groups": groups}
        if self.delayed is not None:  # the masters are one update ahead of the model's CPU-stepped weights
            out["delayed"] = self.delayed.state()
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved at any fraction or device; the model's weights are set from the masters, except
        a delayed update's pending weights resumed with delayed_param_update at the same split (delayed.py)."""
        if state_dict.get("format") != STATE_FORMAT:
            raise ValueError(f"not a HybridDeviceOptimizer state dict (format={state_dict.get('format')!r})")
        if state_dict["optimizer"] != self.kind:
            raise ValueError(f"state dict is for optimizer={state_dict['optimizer']!r}, this one is {self.kind!r}")
        saved = state_dict["state"]
        if set(saved) != set(self.names):
            diff = sorted(set(saved) ^ set(self.names))
            raise ValueError(f"state dict parameter names differ from this optimizer's: {diff[:5]}")
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError("state dict has a different number of param groups")
        self._build()
        self.synchronize()
        for g, sg in zip(self.param_groups, state_dict["param_groups"], strict=True):
            g.update({k: v for k, v in sg.items() if k != "params"})
        keep: set[str] = set()
        if self.delayed is not None:
            masters = {n: saved[n]["master"] for n in self.cpu_names}
            keep = self.delayed.load(state_dict.get("delayed"), (int(st["step"]) for st in saved.values()), masters)
        _say_dtype_changes(saved, self.options)
        if self.cpu is not None and self.cpu.host.remainders:
            keep |= self.cpu_names  # the remainder form sets these weights itself: the masters' high halves
        keep |= self.gpu.sets_weights
        # the parts that hold moments in any form read block-wise 8-bit codes themselves (blockwise.load_moment);
        # the fp32 GPU part and torch.optim get their values
        reads_codes = {id(self.gpu): isinstance(self.gpu, NarrowGpuPart),
                       id(self.cpu): self.cpu is not None and self.cpu.host.m is not None}  # fmt: skip
        ahead = self._masters_ahead()
        for n in self.names:
            side = self.cpu if n in self.cpu_names else self.gpu
            st = saved[n] if reads_codes[id(side)] else blockwise.widened(saved[n])
            if side is self.cpu:
                self.cpu.load(n, st, ahead.get(n))
            else:
                side.load(n, st)
            if n not in keep:  # kept: the model's loaded weights are the ones the next forward reads
                p = self.params_by_name[n]
                p.copy_(saved[n]["master"].to(device=p.device, dtype=p.dtype).reshape(p.shape))

    def _masters_ahead(self) -> dict[str, torch.Tensor]:
        """The weights one update ahead of the model's, by name: a pending delayed update's shadow (its rounded
        masters, which the remainder form's master is split from), else none."""
        return self.delayed.shadow if self.delayed is not None and self.delayed.pending else {}

    def host_bytes(self) -> int:
        """Bytes of host memory held by the optimizer (host masters, states, gradient and weight buffers)."""
        self._build()
        return self.cpu.host_bytes() if self.cpu is not None else 0

    def comm_hook(self) -> None:
        """DDP's all-reduce serves it (EngineOptimizer)."""
        return None

    def cpu_offload(self, micro_batches: int) -> CpuOffload | None:
        """The CPU-stepped share (EngineOptimizer): master (for half weights) and states off the GPU; per step the
        gradient comes down (fp32 sums with accumulation in fp32 over micro-batches) and the weight goes back."""
        params = [self.params_by_name[n] for n in self.cpu_names]
        if not params:
            return None
        moments = self.options.exp_avg_dtype.itemsize + self.options.exp_avg_sq_dtype.itemsize
        state_bytes = moments if self.kind == "adam" else 4  # exp_avg + exp_avg_sq, or the momentum buffer
        fp32_sums = micro_batches > 1 and self.accumulate_grads_in_fp32
        freed = sum(p.numel() * (state_bytes + (4 if p.dtype in _HALF else 0)) for p in params)
        moved = sum(p.numel() * ((4 if fp32_sums and p.dtype in _HALF else p.element_size()) + p.element_size())
                    for p in params)  # fmt: skip
        total = sum(p.numel() for p in self.params_by_name.values())
        return CpuOffload(sum(p.numel() for p in params), total, freed, moved)

    def cpu_step_timing(self) -> dict[str, float] | None:
        """The last finished CPU step's timing (cpu_side.StepTiming), or None with nothing stepped on the CPU."""
        return self.cpu.timing if self.cpu is not None else None
