"""The data-parallel pieces the engine composes: DDP over the model, gradient-sync control for accumulation,
averaging a value over ranks, work done on rank 0 only. Each is the identity with one process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as tdist
from torch import nn

from engine.dist.group import is_distributed, is_main, world_size

T = TypeVar("T")


def wrap_model(
    module: nn.Module, device: torch.device, optimizer: Any = None, find_unused_parameters: bool = False
) -> nn.Module:
    """The module the engine runs forward through: DDP over `module` when distributed (gradients all-reduced
    in buckets while backward runs, or reduced to their owners when `optimizer`, an EngineOptimizer, shards
    and gives a `comm_hook()`), else `module` itself. DDP broadcasts rank 0's weights at construction.

    find_unused_parameters: DDP walks the autograd graph after each forward and marks parameters the step did
    not use as ready, so their buckets still reduce (without it such a model fails on its next forward)."""
    if not is_distributed():
        return module
    ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(module, device_ids=ids, find_unused_parameters=find_unused_parameters)
    hook = None if optimizer is None else optimizer.comm_hook()
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    return ddp


def set_grad_sync(module: nn.Module, sync: bool) -> None:
    """Before a micro-batch's forward: reduce gradients in its backward only if it is the last micro-batch.

    DDP's `no_sync()` context sets this flag; the engine's forward/backward/step loop API cannot hold a
    context across calls, so it sets the flag DDP reads at forward time directly."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        module.require_backward_grad_sync = sync


def average(value: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over ranks (e.g. the loss to log); `value` itself with one process."""
    if not is_distributed():
        return value
    out = value.detach().clone()
    tdist.all_reduce(out)  # a synchronisation the log's loss needs; once per global batch
    return out / world_size()


def on_main(fn: Callable[[], T]) -> T:
    """Runs `fn` on rank 0 only (e.g. writing a checkpoint) and returns its result on every rank, after it is done."""
    if not is_distributed():
        return fn()
    box = [fn() if is_main() else None]
    tdist.broadcast_object_list(box, src=0)  # also the barrier: no rank moves on before the write is complete
    return box[0]
