"""The GPU-stepped part: fp32 master weights for half parameters and a torch optimizer over them.

fp32 parameters are their own masters (no copy, so `offload_fraction=0` on an fp32 model is a
plain torch optimizer); bf16/fp16 parameters get an fp32 master (Megatron's param_update_in_fp32)
that the optimizer steps, after which the half weights are refreshed from it in one foreach copy.
On CUDA the torch optimizer is the fused AdamW; on CPU the default one, so CPU tests can compare bit for bit.
With narrow states (the precision-aware optimizer's exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders)
`gpu_part` builds gpu_narrow.NarrowGpuPart instead: the same arithmetic, states stored narrow (one Triton pass on
CUDA, narrow_kernel.py; fp32 slices elsewhere).
`gpu_side_bytes` states what either holds; the memory plan calls it.
"""

from __future__ import annotations

import torch

from engine.optim.adam_math import Hyper, apply_hypers
from engine.optim.gpu_narrow import NARROW_DTYPES, NarrowGpuPart, narrow_gpu_bytes, narrow_step_bytes

_FP32_STATES = (torch.float32, torch.float32)


def gpu_side_bytes(numel: int, *, kind: str, momentum: bool, half_weights: bool, main_grads: bool,
                   moment_bytes: tuple[int, int] = (4, 4), remainders: bool = False,
                   coded: tuple[bool, bool] = (False, False), blocks: int = 0) -> dict[str, int]:  # fmt: skip
    """GPU bytes of the GPU-stepped part over `numel` parameters: master_weights and optimizer_states (held),
    optimizer_step_staging (during the step only). half_weights: bf16/fp16 weights (else fp32, their own masters);
    main_grads: the gradients arrive as fp32 sums; momentum: SGD with a momentum buffer; moment_bytes: the
    (exp_avg, exp_avg_sq) element sizes; remainders: the bf16 weight + int16 remainder master; coded: moments held
    as block-wise 8-bit codes, blocks: the parameters' quantisation blocks (gpu_narrow.narrow_gpu_bytes)."""
    if kind == "adam" and (moment_bytes != (4, 4) or remainders):
        return narrow_gpu_bytes(numel, half_weights=half_weights, moment_bytes=moment_bytes, remainders=remainders,
                                coded=coded, blocks=blocks)  # fmt: skip
    states = {"adam": 8, "sgd": 4 if momentum else 0}[kind]
    # the fp32 copies of half gradients the torch optimizer steps on (fp32 sums are stepped on directly)
    staging = 4 * numel if half_weights and not main_grads else 0
    return {"master_weights": 4 * numel if half_weights else 0, "optimizer_states": states * numel,
            "optimizer_step_staging": staging}  # fmt: skip


FP32_STEP_BYTES = 32  # per parameter: fp32 master, m and v read and written, the gradient read, the weight written


def gpu_step_bytes(*, kind: str, half_weights: bool, grad_bytes: int, moment_bytes: tuple[int, int] = (4, 4),
                   remainders: bool = False) -> int:  # fmt: skip
    """Device-memory bytes the GPU part's step moves per parameter (what bounds its time; the step-time model
    prices it)."""
    if kind == "adam" and (moment_bytes != (4, 4) or remainders):
        return narrow_step_bytes(moment_bytes=moment_bytes, remainders=remainders, half_weights=half_weights,
                                 grad_bytes=grad_bytes)  # fmt: skip
    return FP32_STEP_BYTES


def gpu_part(entries: list[tuple[str, torch.nn.Parameter, int]], *, kind: str, n_groups: int,
             moment_dtypes: tuple[torch.dtype, torch.dtype] = _FP32_STATES,
             remainders: bool = False) -> GpuPart | NarrowGpuPart:  # fmt: skip
    """The GPU-stepped part: fp32 states as today (GpuPart), or narrow ones (Adam only: options.py checks)."""
    if moment_dtypes == _FP32_STATES and not remainders:
        return GpuPart(entries, kind=kind, n_groups=n_groups)
    for key, dtype in zip(("exp_avg_dtype", "exp_avg_sq_dtype"), moment_dtypes, strict=True):
        if entries and dtype not in NARROW_DTYPES:
            raise ValueError(f"{key} (optimizer.{key})={dtype} is not built on the GPU-stepped part (fp32, bf16, "
                             "fp16 or the block-wise 8-bit codes there): use one of them")  # fmt: skip
    return NarrowGpuPart(entries, moment_dtypes=moment_dtypes, remainders=remainders)


class GpuPart:
    def __init__(self, entries: list[tuple[str, torch.nn.Parameter, int]], *, kind: str, n_groups: int) -> None:
        self.kind = kind
        self.params = {n: p for n, p, _ in entries}
        self.master = {n: (p if p.dtype == torch.float32 else p.detach().float().clone()) for n, p, _ in entries}
        by_group: dict[int, list[torch.Tensor]] = {gi: [] for gi in range(n_groups)}
        for n, _, gi in entries:
            by_group[gi].append(self.master[n])
        groups = [{"params": ps, "gi": gi} for gi, ps in by_group.items() if ps]
        self.opt: torch.optim.Optimizer | None = None
        if groups:
            on_cuda = all(m.is_cuda for m in self.master.values())
            if kind == "adam":
                self.opt = torch.optim.AdamW(groups, lr=0.0, fused=True if on_cuda else None)
            else:
                self.opt = torch.optim.SGD(groups, lr=0.0, momentum=0.0)

    sets_weights = frozenset()  # load sets no weights itself: the caller sets them from the masters

    def held_bytes(self) -> dict[str, int]:
        """The tensors held between steps (after the first), by the memory plan's parts."""
        masters = [m for n, m in self.master.items() if m is not self.params[n]]
        states = [t for s in (self.opt.state.values() if self.opt is not None else ()) for k, t in s.items()
                  if k != "step" and torch.is_tensor(t)]  # fmt: skip
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"master_weights": size(masters), "optimizer_states": size(states)}

    def step(self, grads: dict[str, torch.Tensor], hypers: list[Hyper], inv_scale: float, coef: float) -> None:
        """grads: name -> final gradient (the parameter's shape) for the parameters that have one."""
        if self.opt is None or not grads:
            return
        gs = []
        for n, g in grads.items():
            m = self.master[n]
            m.grad = g if g.dtype == torch.float32 else g.float()
            gs.append(m.grad)
        if inv_scale != 1.0:
            torch._foreach_mul_(gs, inv_scale)
        if coef != 1.0:
            torch._foreach_mul_(gs, coef)  # the same fp32 factor torch's clip_grad_norm_ multiplies by
        apply_hypers(self.opt, hypers, self.kind)
        self.opt.step()
        halves = [(self.params[n], self.master[n]) for n in grads if self.master[n] is not self.params[n]]
        if halves:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in halves], [m for _, m in halves])
        for n in grads:
            if self.master[n] is not self.params[n]:
                self.master[n].grad = None

    def export(self, name: str) -> dict:
        m = self.master[name]
        s = self.opt.state.get(m, {}) if self.opt is not None else {}
        step = s.get("step", 0)
        st: dict = {
            "step": int(step.item()) if torch.is_tensor(step) else int(step),
            "master": m.detach().float().cpu().clone(),
        }
        for k in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if torch.is_tensor(s.get(k)):
                st[k] = s[k].detach().float().cpu().clone()
        return st

    def load(self, name: str, st: dict) -> None:
        m = self.master[name]
        with torch.no_grad():
            m.copy_(st["master"].reshape(m.shape))
        if self.opt is None:
            return
        new = {k: st[k].to(device=m.device, dtype=torch.float32).reshape(m.shape).clone()
               for k in ("exp_avg", "exp_avg_sq", "momentum_buffer") if k in st}  # fmt: skip
        if self.kind == "adam" and new:
            fused = bool(self.opt.param_groups[0].get("fused"))
            new["step"] = torch.tensor(float(st["step"]), dtype=torch.float32, device=m.device if fused else "cpu")
        self.opt.state[m] = new
