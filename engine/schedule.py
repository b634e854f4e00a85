"""The learning-rate schedule (Megatron's OptimizerParamScheduler semantics): linear warmup from 0,
then constant, linear or cosine decay to `min_lr` over `lr_decay_iters`, then `min_lr`."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, lr: float, min_lr: float, warmup_iters: int, decay_iters: int, style: str) -> float:
    """Learning rate for optimizer step `step` (1-based: the first step uses lr_at(1))."""
    if warmup_iters > 0 and step <= warmup_iters:
        return lr * step / warmup_iters
    if style == "constant":
        return lr
    if step >= decay_iters:
        return min_lr
    ratio = (step - warmup_iters) / max(1, decay_iters - warmup_iters)
    if style == "linear":
        return min_lr + (lr - min_lr) * (1.0 - ratio)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * ratio))


class WarmupDecayLR(torch.optim.lr_scheduler.LRScheduler):
    """Sets every param group's lr to `lr_at(step)`; `step()` is called after each optimizer step.

    Groups keep their own peak lr as `initial_lr` scaled by the schedule, so per-group lrs survive.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        lr: float,
        min_lr: float,
        warmup_iters: int,
        decay_iters: int,
        style: str,
    ) -> None:
        self.peak_lr, self.min_lr = lr, min_lr
        self.warmup_iters, self.decay_iters, self.style = warmup_iters, decay_iters, style
        super().__init__(optimizer)

    def _value(self, step: int) -> float:
        return lr_at(
            step,
            lr=self.peak_lr,
            min_lr=self.min_lr,
            warmup_iters=self.warmup_iters,
            decay_iters=self.decay_iters,
            style=self.style,
        )

    def get_lr(self) -> list[float]:
        # last_epoch counts completed optimizer steps; the lr set now serves step last_epoch + 1
        factor = self._value(self.last_epoch + 1) / self.peak_lr if self.peak_lr else 0.0
        return [base * factor for base in self.base_lrs]
