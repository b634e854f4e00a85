"""The CPU part's arithmetic: what one step computes on the host, apart from where tensors live and when.

`CpuArith` is the one interface cpu_side.py steps through: step a unit in place (`step_unit`), and, where
`speculates`, step it out of place into a spare (`guess`); the states it owns itself (torch.optim's) travel
through `export`/`load` and are counted by `tensors`. Two implementations:
FusedAdamW        the engine's AdamW over flat tensors: the compiled pass (fused_kernel) in slices on
                  worker threads (ctypes releases the GIL), or torch's single-tensor ops where it did not
                  build. In place or out of place (the speculative step), with the half weights written in
                  the same pass. States fp32, or narrow (bf16/fp16 moments, the remainder master): read and
                  written in their form in the same pass.
TorchOptimizers   torch.optim on the host masters, one optimizer per layer unit so units still step and
                  travel back one by one (SGD, or use_torch_optimizer_for_cpu_offload); it owns its states.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.optim import blockwise, fused_kernel, remainder
from engine.optim.adam_math import Hyper, adamw_scalars, adamw_torch_, apply_hypers
from engine.optim.device_arith import DeviceArith
from engine.optim.host_state import HostState

_MIN_SLICE = 1 << 16  # elements: below this a slice costs more in dispatch than it saves
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


@dataclass(frozen=True)
class TensorStep:
    """AdamW on one parameter's flat state (p, m, v) with gradient g (any float dtype), results into
    (p_out, m_out, v_out) (the same tensors for an in-place step) and, when given, its half weights. p is the
    fp32 master, or with rem the bf16 weight of the remainder form; m and v are fp32, bf16 or fp16."""

    p: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    p_out: torch.Tensor
    m_out: torch.Tensor
    v_out: torch.Tensor
    half_out: torch.Tensor | None
    scalars: tuple[float, ...]  # adam_math.adamw_scalars
    rem: torch.Tensor | None = None  # the remainder form (remainder.py): p, p_out are bf16 weights, these int16
    rem_out: torch.Tensor | None = None
    ms: torch.Tensor | None = None  # per-block scales of a moment held as block-wise 8-bit codes (blockwise.py)
    vs: torch.Tensor | None = None
    ms_out: torch.Tensor | None = None
    vs_out: torch.Tensor | None = None
    device: tuple[float, ...] | None = None  # device_arith.DeviceArith.scalars: the GPU's fused arithmetic instead

    @property
    def in_place(self) -> bool:
        """Every output is its input (the remainder form's guess steps its weights in place, its states not)."""
        pairs = ((self.p_out, self.p), (self.m_out, self.m), (self.v_out, self.v), (self.rem_out, self.rem),
                 (self.ms_out, self.ms), (self.vs_out, self.vs))  # fmt: skip
        return all(o is i for o, i in pairs)

    @property
    def narrow(self) -> bool:
        """A state is narrower than fp32 (a 16-bit or coded moment, the remainder master): the narrow pass steps it."""
        return self.m.dtype != torch.float32 or self.v.dtype != torch.float32 or self.rem is not None

    @property
    def coded(self) -> bool:
        """A moment is held as block-wise 8-bit codes (slices then start on a block boundary)."""
        return self.ms is not None or self.vs is not None


@dataclass(frozen=True)
class UnitStep:
    """One unit's in-place step: the names of `unit` that have a gradient, with the step's settings."""

    unit: str
    names: list[str]
    grads: dict[str, torch.Tensor]  # name -> host staging view (any float dtype)
    hypers: list[Hyper]  # by param group
    inv_scale: float
    coef: float  # the clip factor
    half: dict[str, torch.Tensor] | None  # where the half weights go (None: fp32 weights travel from the master)


class CpuArith(Protocol):
    lib: object | None  # the compiled pass, when it runs the step
    speculates: bool  # steps out of place (guess) for the speculative step

    def step_unit(self, s: UnitStep) -> None: ...

    def guess(self, unit: str, names: list[str], grads: dict[str, torch.Tensor],
              out: dict[str, tuple[torch.Tensor, ...]], half: dict[str, torch.Tensor] | None,
              hypers: list[Hyper]) -> None: ...  # fmt: skip

    def export(self, name: str) -> dict[str, torch.Tensor]: ...

    def load(self, name: str, st: dict) -> None: ...

    def tensors(self) -> list[torch.Tensor]: ...

    def close(self) -> None: ...


class FusedAdamW:
    """The engine's AdamW over the host state's flat tensors (which it does not own)."""

    speculates = True

    def __init__(self, lib, threads: int, host: HostState, group_of: dict[str, int],
                 initializer: Callable[[], None] | None = None, device: DeviceArith | None = None) -> None:  # fmt: skip
        """lib: fused_kernel.load()'s library, or None for torch's ops. initializer: run by each worker
        thread as it starts (affinity.py binds it to a core). device: step fp32 states in the GPU's fused AdamW
        arithmetic (device_arith.py; the compiled pass only)."""
        self.lib = lib
        narrow = host is not None and (host.remainders or host.moment_dtypes != (torch.float32, torch.float32))
        fits = device is not None and (not narrow or device.code in fused_kernel.NARROW_MATH)
        self.device = device if lib is not None and fits else None  # the narrow passes compile FLOAT only
        self.threads = threads
        self.host = host
        self.group_of = group_of
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="cpu-adam", initializer=initializer)

    def _scalars(self, name: str, hypers: list[Hyper], inv_scale: float, coef: float) -> tuple[float, ...]:
        return adamw_scalars(hypers[self.group_of[name]], self.host.steps[name] + 1, inv_scale, coef)

    def _device_scalars(self, name: str, hypers: list[Hyper], inv_scale: float, coef: float) -> tuple | None:
        if self.device is None:
            return None
        return self.device.scalars(hypers[self.group_of[name]], self.host.steps[name] + 1, inv_scale, coef)

    def _tensor_step(self, n: str, g: torch.Tensor, out: tuple, half: dict | None, scalars: tuple,
                     device: tuple | None = None) -> TensorStep:  # fmt: skip
        """Parameter n's step from its held state into out = (master, m, v, m scales, v scales). With the
        remainder form `half` holds the unit's bf16 weights as the GPU has them (read back by the caller), stepped
        in place: they are the half weights to upload; the master in and out are remainders."""
        master, m, v = self.host.state(n)
        ms, vs = self.host.scales(n)
        p_out, m_out, v_out, ms_out, vs_out = out
        if self.host.remainders:
            return TensorStep(half[n], m, v, g, half[n], m_out, v_out, None, scalars, master, p_out,
                              ms, vs, ms_out, vs_out, device)  # fmt: skip
        return TensorStep(master, m, v, g, p_out, m_out, v_out, half[n] if half else None, scalars, None, None,
                          ms, vs, ms_out, vs_out, device)  # fmt: skip

    def step_unit(self, s: UnitStep) -> None:
        self.step([self._tensor_step(n, s.grads[n], (*self.host.state(n), *self.host.scales(n)), s.half,
                                     self._scalars(n, s.hypers, s.inv_scale, s.coef),
                                     self._device_scalars(n, s.hypers, s.inv_scale, s.coef))
                   for n in s.names])  # fmt: skip

    def guess(self, unit, names, grads, out, half, hypers) -> None:
        """Step `names` out of place into `out` (name -> host_state.spare_views' tuple), as if unclipped and
        unscaled."""
        self.step([self._tensor_step(n, grads[n], out[n], half, self._scalars(n, hypers, 1.0, 1.0),
                                     self._device_scalars(n, hypers, 1.0, 1.0)) for n in names])  # fmt: skip

    def export(self, name: str) -> dict[str, torch.Tensor]:
        return {}  # its states are the host state's

    def load(self, name: str, st: dict) -> None:
        pass

    def tensors(self) -> list[torch.Tensor]:
        return []

    def step(self, steps: list[TensorStep]) -> None:
        futs: list[Future] = []
        for s in steps:
            if s.narrow:
                numel = s.p.numel()
                chunk = -(-max(_MIN_SLICE, -(-numel // self.threads)) // blockwise.BLOCK) * blockwise.BLOCK
                for a in range(0, numel, chunk):
                    b = min(numel, a + chunk)
                    if self.lib is None:
                        futs.append(self.pool.submit(narrow_slice, s, a, b))
                    else:
                        futs.append(self.pool.submit(fused_kernel.narrow_slice, self.lib, a, b, s))
                continue
            if self.lib is None:
                if not s.in_place:
                    s.p_out.copy_(s.p), s.m_out.copy_(s.m), s.v_out.copy_(s.v)
                adamw_torch_(s.p_out, s.m_out, s.v_out, s.g, None, s.scalars)
                if s.half_out is not None:
                    s.half_out.copy_(s.p_out)
                continue
            numel = s.p.numel()
            chunk = max(_MIN_SLICE, -(-numel // self.threads))
            for a in range(0, numel, chunk):
                b = min(numel, a + chunk)
                futs.append(self.pool.submit(fused_kernel.adamw_slice, self.lib, a, b, s.p, s.m, s.v, s.g, None,
                                             s.p_out, s.m_out, s.v_out, s.half_out, s.scalars,
                                             device=s.device))  # fmt: skip
        for f in futs:
            f.result()

    def close(self) -> None:
        self.pool.shutdown(wait=False)


def narrow_slice(s: TensorStep, a: int, b: int) -> None:
    """AdamW on [a, b) with exp_avg/exp_avg_sq stored narrow (bf16, fp16 or block-wise 8-bit codes) and/or the
    master in the remainder form, in torch ops (where the compiled pass did not build; they release the GIL: one
    slice per worker): moments read and widened to fp32 (codes dequantised), the fp32 update of adamw_torch_,
    written back rounded to nearest even (torch's conversion) or requantised per block (a on a block boundary of
    the parameter); the master as fp32 or joined and split again (remainder.py)."""
    g = s.g[a:b]
    blocks = blockwise.block_slice(a, b)

    def widened(t: torch.Tensor, scale: torch.Tensor | None, signed: bool) -> torch.Tensor:
        if scale is not None:  # the block-wise 8-bit form: its codes' values
            return blockwise.dequantise(t[a:b], scale[blocks], signed)
        # an fp32 moment's .float() is the moment itself: copied when the step must leave its inputs alone
        return t[a:b].to(torch.float32, copy=not s.in_place)

    m, v = widened(s.m, s.ms, True), widened(s.v, s.vs, False)
    if s.rem is not None:
        p = remainder.join(s.p[a:b], s.rem[a:b])
        adamw_torch_(p, m, v, g, None, s.scalars)
        w, rem = remainder.split(p)
        s.p_out[a:b].copy_(w)
        s.rem_out[a:b].copy_(rem)
    else:
        p_out = s.p_out[a:b]
        if not s.in_place:
            p_out.copy_(s.p[a:b])
        adamw_torch_(p_out, m, v, g, None, s.scalars)
        if s.half_out is not None:
            s.half_out[a:b].copy_(p_out)
    for out, scale, x, signed in ((s.m_out, s.ms_out, m, True), (s.v_out, s.vs_out, v, False)):
        if scale is not None:
            codes, absmax = blockwise.quantise(x, signed)
            out[a:b].copy_(codes)
            scale[blocks].copy_(absmax)
        else:
            out[a:b].copy_(x)


RATE_HYPER = Hyper(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, momentum=0.0)


def step_rate(numel: int, threads: int, *, moments: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
              grad: torch.dtype = torch.bfloat16, half: torch.dtype | None = torch.bfloat16, remainders: bool = False,
              initializer: Callable[[], None] | None = None, reps: int = 5) -> float:  # fmt: skip
    """Parameters per second `FusedAdamW` steps in place: `numel` parameters in one state form (moments' dtypes,
    the remainder master or an fp32 one writing `half` weights, gradients in `grad`), through the pass the CPU part
    runs (the compiled one where it built) at `threads` threads bound by `initializer`. The median of `reps` steps
    after one warm-up (first touch, the pool's threads starting)."""
    p = torch.full((numel,), 0.01)
    m, v = torch.zeros(numel, dtype=moments[0]), torch.zeros(numel, dtype=moments[1])
    g = torch.full((numel,), 1e-3, dtype=grad)
    scalars = adamw_scalars(RATE_HYPER, 2, 1.0, 1.0)
    if remainders:
        w, rem = remainder.split(p)
        step = TensorStep(w, m, v, g, w, m, v, None, scalars, rem, rem)
    else:
        out = None if half is None else torch.empty(numel, dtype=half)
        step = TensorStep(p, m, v, g, p, m, v, out, scalars)
    arith = FusedAdamW(fused_kernel.load(), threads, host=None, group_of={}, initializer=initializer)
    try:
        arith.step([step])
        seconds = []
        for _ in range(reps):
            start = time.perf_counter()
            arith.step([step])
            seconds.append(time.perf_counter() - start)
    finally:
        arith.close()
    return numel / statistics.median(seconds)


class TorchOptimizers:
    """torch.optim on the host masters; it owns its states (exported and loaded by name)."""

    lib = None
    speculates = False

    def __init__(self, kind: str, host: HostState, group_of: dict[str, int]) -> None:
        """The host state's masters are stepped in place; these tensors key the optimizers' states."""
        units = host.layout.units
        master = {n: host.state(n)[0] for n in host.layout.unit_of}
        self.host = host
        self.kind = kind
        self.units = units
        self.master = master
        self.unit_of = {n: u for u, ns in units.items() for n in ns}
        self.opt: dict[str, torch.optim.Optimizer] = {}
        for u, names in units.items():
            by_group: dict[int, list[torch.Tensor]] = {}
            for n in names:
                by_group.setdefault(group_of[n], []).append(master[n])
            groups = [{"params": ps, "gi": gi} for gi, ps in by_group.items()]
            if kind == "adam":
                self.opt[u] = torch.optim.AdamW(groups, lr=0.0, fused=True)
            else:
                self.opt[u] = torch.optim.SGD(groups, lr=0.0, momentum=0.0)

    def guess(self, unit, names, grads, out, half, hypers) -> None:
        raise NotImplementedError("torch.optim steps in place only")

    def step_unit(self, s: UnitStep) -> None:
        """Each gradient goes through its fp32 view in the host's scratch, unscaled and clipped as the GPU side
        does; s.half, when given, receives the half weights."""
        unit, names, grads, hypers, inv_scale, coef, half_out = (s.unit, s.names, s.grads, s.hypers, s.inv_scale,
                                                                 s.coef, s.half)  # fmt: skip
        scratch = self.host.layout.views(self.host.scratch, unit)
        for n in self.units[unit]:
            self.master[n].grad = None  # a parameter without a gradient this step is not stepped
        for n in names:
            g = scratch[n]
            g.copy_(grads[n])
            if inv_scale != 1.0:
                g.mul_(inv_scale)
            if coef != 1.0:
                g.mul_(coef)
            self.master[n].grad = g
        apply_hypers(self.opt[unit], hypers, self.kind)
        self.opt[unit].step()
        for n in names:
            self.master[n].grad = None
            if half_out is not None:
                half_out[n].copy_(self.master[n])

    def export(self, name: str) -> dict[str, torch.Tensor]:
        shape = self.host.layout.shape[name]
        s = self.opt[self.unit_of[name]].state.get(self.master[name], {})
        return {k: s[k].view(shape).clone() for k in _STATE_KEYS if torch.is_tensor(s.get(k))}

    def load(self, name: str, st: dict) -> None:
        step = int(st["step"])
        new = {k: st[k].reshape(-1).clone().float() for k in _STATE_KEYS if k in st}
        if self.kind == "adam" and new:
            new["step"] = torch.tensor(float(step), dtype=torch.float32)
        self.opt[self.unit_of[name]].state[self.master[name]] = new

    def close(self) -> None:
        pass  # no threads of its own

    def tensors(self) -> list[torch.Tensor]:
        """The per-element state tensors (not torch's scalar step counts)."""
        states = [s for o in self.opt.values() for s in o.state.values()]
        return [s[k] for s in states for k in _STATE_KEYS if torch.is_tensor(s.get(k))]
