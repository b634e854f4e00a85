"""The optimizer arithmetic, apart from where tensors live.

`Hyper` is one parameter group's hyperparameters at one step; `adamw_scalars` turns it into
the fp32 scalars of the fused pass; `adamw_torch_` is the same update in torch ops, op for op
torch's single-tensor AdamW: on the CPU it stands in for the C pass when that cannot be built, and on
CUDA, where torch's kernels round as the C pass does, the GPU assist runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Hyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    momentum: float

    @staticmethod
    def of(group: dict) -> Hyper:
        b1, b2 = group["betas"]
        return Hyper(float(group["lr"]), float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]),
                     float(group["momentum"]))  # fmt: skip


def apply_hypers(opt: torch.optim.Optimizer, hypers: list[Hyper], kind: str) -> None:
    """Hands each group's current hyperparameters to a torch optimizer whose groups carry their index as "gi"."""
    for group in opt.param_groups:
        h = hypers[group["gi"]]
        group.update(lr=h.lr, weight_decay=h.weight_decay)
        if kind == "adam":
            group.update(betas=(h.beta1, h.beta2), eps=h.eps)
        else:
            group.update(momentum=h.momentum)


def adamw_scalars(h: Hyper, step: int, inv_scale: float, coef: float) -> tuple[float, ...]:
    """(inv_scale, coef, decay, w1, beta2, 1-beta2, sqrt(bias_correction2), eps, -step_size) for step >= 1."""
    bc1 = 1 - h.beta1**step
    bc2 = 1 - h.beta2**step
    # bc2**0.5 as torch.optim's single-tensor AdamW takes it (math.sqrt differs in the last bit at times)
    return (inv_scale, coef, 1 - h.lr * h.weight_decay, 1 - h.beta1, h.beta2, 1 - h.beta2, bc2**0.5, h.eps,
            -h.lr / bc1)  # fmt: skip


def adamw_torch_(
    p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, acc: torch.Tensor | None, s: tuple[float, ...]
) -> None:
    """In-place AdamW on fp32 p, m, v (same shape) from grad g (any float dtype); s from `adamw_scalars`."""
    inv_scale, coef, decay, w1, beta2, omb2, bc2_sqrt, eps, neg_step = s
    g = g.float() if acc is None else acc + g.float()
    if inv_scale != 1.0:
        g = g * inv_scale
    if coef != 1.0:
        g = g * coef
    p.mul_(decay)
    m.lerp_(g, w1)
    v.mul_(beta2).addcmul_(g, g, value=omb2)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=neg_step)
