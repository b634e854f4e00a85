"""The optimizer interface the Engine steps through, and the one unscale / clip / finite check.

`EngineOptimizer` is what the Engine (and the DistributedOptimizer, of its per-rank inner optimizer) needs from
an optimizer. Implementations: HybridDeviceOptimizer (optim/hybrid.py), DistributedOptimizer
(optim/distributed.py), MegatronOptimizerAdapter (megatron/optimizer.py), and `TorchOptimizer` here, which
`as_engine_optimizer` puts around any other optimizer (a plain torch.optim one a user passes) once, so code that
steps an optimizer never asks what kind it has.

Every implementation updates its parameters inside its own `step()`: torch's LR schedulers wrap `step` of the
optimizer they are given to know it stepped (the warning "lr_scheduler.step() before optimizer.step()"), so
`clip_and_step` reaches the update through `step`, never around it.

The step's decision is made once, here: `decide` takes the global norm of the unscaled gradients, returns the clip
factor (torch.nn.utils.clip_grad_norm_'s) and whether to step, in the step's one host synchronisation;
`unscale_and_clip_` is that for optimizers whose gradients are unscaled and clipped in place.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class EngineOptimizer(Protocol):
    """What the Engine needs from an optimizer. `param_groups` are torch's (an LR schedule sets their "lr")."""

    param_groups: list[dict]
    last_step_delayed: bool  # the last step's update lands one step late (optimizer.delayed_param_update)

    def clip_and_step(
        self, max_norm: float, grad_scale: float = 1.0, *, finite: torch.Tensor | None = None
    ) -> tuple[float, bool]:
        """Unscale the gradients by 1/grad_scale, clip their global L2 norm to max_norm (<= 0: no clipping), step.

        Returns (the global pre-clip norm of the unscaled gradients, stepped). Nothing is updated, and stepped is
        False, when that norm is not finite or `finite` (a 0-d bool tensor, e.g. the loss's check) is False."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...

    def attach_model(self, model: nn.Module) -> None:
        """Called once with the model being trained, before the first step (an optimizer may hook its layers)."""
        ...

    def set_grad_final(self, is_final: bool) -> None:
        """Before each backward: True when this backward completes the gradients (the last micro-batch)."""
        ...

    def synchronize(self) -> None:
        """Returns once every update is in the model's weights (updates may be written back asynchronously)."""
        ...

    def host_bytes(self) -> int:
        """Bytes this optimizer holds in host memory for offloading (0 when it offloads nothing)."""
        ...

    def comm_hook(self) -> Callable | None:
        """The DDP communication hook its gradients need (a sharded optimizer reduces each to its owner), or None
        for DDP's all-reduce."""
        ...

    def cpu_step_timing(self) -> dict[str, float] | None:
        """The last finished CPU step's timing (engine.optim.cpu_side.StepTiming's fields), or None when nothing
        is stepped on the CPU."""
        ...

    def cpu_offload(self, micro_batches: int) -> CpuOffload | None:
        """What this optimizer steps on the CPU with `micro_batches` backward passes per step, or None (nothing)."""
        ...


class CpuOffload(NamedTuple):
    """What an optimizer steps on the CPU, for the run's summary: parameters stepped there out of all of them,
    the GPU bytes their fp32 master weights and optimizer states no longer take, and the bytes one step copies
    (gradients to the host, weights back)."""

    cpu_params: int
    total_params: int
    gpu_bytes_freed: int
    bytes_per_step: int


class Decision(NamedTuple):
    """The step's decision, on the host: `norm` of the unscaled gradients before clipping, the `coef` clipping
    multiplies them by (1.0 without clipping), and whether to step (`ok`)."""

    norm: float
    coef: float
    ok: bool


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor clipping to max_norm multiplies the unscaled gradients by, as torch.nn.utils.clip_grad_norm_
    computes it (clamped to 1, so no branch needs the value on the host); ones without clipping (max_norm <= 0)."""
    if max_norm <= 0:
        return torch.ones_like(total_norm)
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def decide(total_norm: torch.Tensor, max_norm: float, finite: torch.Tensor | None = None) -> Decision:
    """The step's decision from the global norm of the unscaled gradients (a 0-d tensor) and an optional extra
    finite flag (the loss's), read in one host synchronisation."""
    coef = clip_coefficient(total_norm, max_norm)
    parts = [total_norm, coef]
    if finite is not None:
        parts.append(finite.to(device=total_norm.device, dtype=total_norm.dtype))
    # THE synchronisation of a step: whether to step, and clipping, need the global norm on the host
    values = torch.stack(parts).tolist()
    ok = math.isfinite(values[0]) and (finite is None or values[2] == 1.0)
    return Decision(values[0], values[1], ok)


@torch.no_grad()
def unscale_and_clip_(
    params: Iterable[torch.Tensor], max_norm: float, grad_scale: float = 1.0, finite: torch.Tensor | None = None
) -> Decision:
    """Unscales (by 1/grad_scale) and clips in place the gradients of `params`, exactly as
    torch.nn.utils.clip_grad_norm_ does after the unscale (unscale_and_clip_grads_: its norm and its clip factor,
    so the norm is read in the same synchronisation as `finite`), and decides the step."""
    return unscale_and_clip_grads_([p.grad for p in params if p.grad is not None], max_norm, grad_scale, finite)


@torch.no_grad()
def unscale_and_clip_grads_(
    grads: list[torch.Tensor], max_norm: float, grad_scale: float = 1.0, finite: torch.Tensor | None = None
) -> Decision:
    """`unscale_and_clip_` over gradient tensors, also ones that are not the `.grad` of a parameter (fp32 copies of
    half gradients): torch's total norm, and the clip coefficient torch's clip_grads_with_norm_ computes and
    multiplies by."""
    if grad_scale != 1.0:
        torch._foreach_mul_(grads, 1.0 / grad_scale)
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for device in {g.device for g in grads}:
            torch._foreach_mul_([g for g in grads if g.device == device], coef.to(device))
    return decide(total, max_norm, finite)


class TorchOptimizer:
    """EngineOptimizer around a torch.optim.Optimizer that is not one (`inner`): the gradients are unscaled and
    clipped in place, then `inner.step()` runs. It offloads nothing and hooks nothing; `param_groups`,
    `zero_grad` and the state dict are `inner`'s own."""

    last_step_delayed = False

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def clip_and_step(
        self, max_norm: float, grad_scale: float = 1.0, *, finite: torch.Tensor | None = None
    ) -> tuple[float, bool]:
        params = [p for g in self.inner.param_groups for p in g["params"]]
        d = unscale_and_clip_(params, max_norm, grad_scale, finite)
        if d.ok:
            self.inner.step()  # inner's own step: an LR schedule built on inner sees it
        return d.norm, d.ok

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)

    def attach_model(self, model: nn.Module) -> None:
        pass

    def set_grad_final(self, is_final: bool) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def host_bytes(self) -> int:
        return 0

    def comm_hook(self) -> Callable | None:
        return None

    def cpu_step_timing(self) -> None:
        return None

    def cpu_offload(self, micro_batches: int) -> None:
        return None


def as_engine_optimizer(optimizer: Any) -> EngineOptimizer:
    """`optimizer` itself when it implements EngineOptimizer, else a TorchOptimizer around it."""
    return optimizer if isinstance(optimizer, EngineOptimizer) else TorchOptimizer(optimizer)
