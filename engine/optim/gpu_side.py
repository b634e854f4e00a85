"""The GPU-stepped part: fp32 master weights for half parameters and a torch optimizer over them.

fp32 parameters are their own masters (no copy, so `offload_fraction=0` on an fp32 model is a
plain torch optimizer); bf16/fp16 parameters get an fp32 master (Megatron's param_update_in_fp32)
that the optimizer steps, after which the half weights are refreshed from it in one foreach copy.
On CUDA the torch optimizer is the fused AdamW; on CPU the default one, so CPU tests can compare bit for bit.
"""

from __future__ import annotations

import torch

from engine.optim.adam_math import Hyper, apply_hypers


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
