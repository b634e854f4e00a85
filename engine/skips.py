"""Skipped steps: a step whose loss or gradient norm is not finite updates nothing. They are counted here,
and `train.max_skipped_steps` consecutive ones end the run with one line naming the iteration and the likely
cause (fp16's dynamic loss scale skips overflowing steps by its own rules; those count too, since a scale
that keeps falling for that many steps means the model itself has gone non-finite).
"""

from __future__ import annotations

import math
from typing import Any


class TrainingDiverged(RuntimeError):
    """`train.max_skipped_steps` consecutive steps were skipped; the message is one line for users, `loss` the
    last step's mean loss (for its metrics record)."""

    def __init__(self, message: str, loss: float) -> None:
        super().__init__(message)
        self.loss = loss


def _show(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else str(x)


class SkippedSteps:
    """Counts of skipped steps: `total`, `consecutive` (since the last step taken) and `taken`."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.limit: int | None = config.train.max_skipped_steps
        self.total = 0
        self.consecutive = 0
        self.taken = 0  # steps taken by this process: none means the run never had a finite step

    def update(self, stepped: bool, iteration: int, loss: float, grad_norm: float, loss_scale: float) -> None:
        """Records one step; raises TrainingDiverged when it makes `limit` consecutive skips.

        `loss` (the mean over the global batch) and `grad_norm` are only read for the message."""
        if stepped:
            self.consecutive = 0
            self.taken += 1
            return
        self.total += 1
        self.consecutive += 1
        if self.limit is not None and self.consecutive >= self.limit:
            raise TrainingDiverged(self.message(iteration, loss, grad_norm, loss_scale), loss)

    def message(self, iteration: int, loss: float, grad_norm: float, loss_scale: float) -> str:
        c = self.config
        what = (
            f"train.max_skipped_steps={self.limit}: stopping at iteration {iteration} after {self.consecutive} "
            f"consecutive skipped steps (loss {_show(loss)}, gradient norm {_show(grad_norm)})"
        )
        if c.train.precision == "fp16" and math.isfinite(loss) and c.train.loss_scale is not None:
            # a static scale is the user's number: the overflow is the scale's, whatever the learning rate
            cause = (
                f"the static train.loss_scale ({c.train.loss_scale:g}) makes the fp16 gradients overflow (fp16's "
                "largest value is 65504); lower train.loss_scale, or set it to null for the dynamic scale"
            )
        elif c.train.precision == "fp16" and math.isfinite(loss):
            cause = (
                f'the fp16 gradients overflow even at loss scale {loss_scale:g}; use train.precision="bf16", or '
                f"lower optimizer.lr ({c.optimizer.lr:g})"
            )
        elif self.taken == 0:
            cause = (
                "the model is non-finite from this run's first step: check model.init_method_std "
                f"({c.model.init_method_std:g}), the checkpoint it resumed from, or the data"
            )
        else:
            cause = (
                f"training diverged after {self.taken} good step{'s' if self.taken > 1 else ''}: the learning rate "
                "is too high "
                f"(optimizer.lr={c.optimizer.lr:g}); lower it, or raise optimizer.lr_warmup_iters "
                f"({c.optimizer.lr_warmup_iters})"
            )
        return f"{what}; likely cause: {cause}"
