"""Out of memory during training as one line: what the plan predicted, what failed, and which keys to change.

`PlannedOutOfMemoryError` is still a `torch.OutOfMemoryError`, so code that catches torch's keeps working; its
message replaces torch's traceback text (the original stays as `__cause__`).
"""

from __future__ import annotations

import re
from typing import Any

import torch

_TRIED = re.compile(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)")


class PlannedOutOfMemoryError(torch.OutOfMemoryError):
    """torch's out-of-memory error, re-raised by the engine with the plan's figures and the keys to change."""


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f}"


def head(error: BaseException, where: str = "") -> str:
    """ "CUDA out of memory in WHERE: allocating N GiB failed", from torch's message."""
    tried = _TRIED.search(str(error))
    failed = f"allocating {tried.group(1)} failed" if tried else "an allocation failed"
    return f"{'CUDA ' if 'CUDA' in str(error) else ''}out of memory{f' in {where}' if where else ''}: {failed}"


def line(error: BaseException, planned: tuple[Any, Any] | None, where: str = "") -> str:
    """One line for `error` (torch's OOM) given (resolved config, plan) or None when no plan was made."""
    first = head(error, where)
    if planned is None:
        return f"{first}; no memory plan was made (bin/train CONFIG --plan, or engine.plan(config, model))"
    cfg, plan = planned
    return (
        f"{first} where the plan said {_gib(plan.gpu.total_bytes)} GiB of {_gib(plan.gpu.budget_bytes)} GiB (peak "
        f"during {plan.gpu.phase}); raise optimizer.optimizer_offload_fraction (now {plan.fraction:.2f}) or "
        f"model.cpu_offloading_num_layers (now {plan.offloaded_layers}), or lower train.micro_batch_size "
        f"(now {cfg.train.micro_batch_size})"
    )


def planned_error(error: torch.OutOfMemoryError, planned: tuple[Any, Any] | None, where: str
                  ) -> PlannedOutOfMemoryError:  # fmt: skip
    """The engine's error for torch's `error` (raise it `from error`)."""
    return PlannedOutOfMemoryError(line(error, planned, where))
