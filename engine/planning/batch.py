"""A user's model measured at the batch it will train on: every layer's and the head's saved storages.

The model runs one real forward of `example_batch` (one micro-batch, the engine's own path: engine.batch moves
it to the model's device, gives `labels` to a model that takes them, turns the output into the loss) under
saved-tensor hooks that record each storage autograd saves, which layer saved it and inside which of its
sub-modules, and then drop the reference. Dropping it keeps the forward's memory at what one layer's and the
loss's working set needs rather than the whole micro-batch's activations, so the real shape can be measured on
the GPU it will train on (a model whose activations need offloading could not hold them all), with the
kernels training runs: flash/SDPA attention and eager attention are measured as they are, nothing is
extrapolated. The backward is never run. The RNG state is restored afterwards.

The loss's backward holds, beyond what the forward saved, the gradient flowing into and out of the op that
saved the largest storage outside the layers (HF's causal-LM loss: the fp32 log-softmax of the upcast
logits, [tokens, vocab]): `logits_transient` is twice that storage. Under model.fused_linear_cross_entropy the
forward runs the fused loss, which saves nothing through autograd (it holds its gradients itself): the loss is
then counted as the bytes engine.models.linear_cross_entropy states it holds, `fused_linear_cross_entropy_bytes`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from engine.batch import BatchLoss, is_causal_lm, takes_labels
from engine.models.linear_cross_entropy import fused_linear_cross_entropy_bytes
from engine.planning.activations import Activations, Saved, backward_working


def batch_rows(batch: Any) -> int | None:
    """The leading dimension of the micro-batch's first tensor (its rows), or None."""
    args, kwargs, _ = BatchLoss.split(batch)
    for t in [*args, *kwargs.values()]:
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return int(t.shape[0])
    return None


def describe(batch: Any) -> str:
    """The batch's tensors' shapes, for the plan's source line."""
    args, kwargs, labels = BatchLoss.split(batch)
    named = {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs, "labels": labels}
    return ", ".join(f"{k} {list(v.shape)}" for k, v in named.items() if isinstance(v, torch.Tensor))


def attention(model: nn.Module) -> str:
    """The attention kernel an HF model runs, which the measurement saw, as ", sdpa attention" (eager, flash, ...)
    (eager attention keeps [heads, seq, seq] probabilities, SDPA/flash memory is linear in tokens); "" otherwise."""
    kernel = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return f", {kernel} attention" if isinstance(kernel, str) else ""


def measure_batch(
    model: nn.Module,
    layers: list[nn.Module],
    batch: Any,
    *,
    loss_fn: Any = None,
    autocast: contextlib.AbstractContextManager | None = None,
    float_dtype: torch.dtype | None = None,
    fused: tuple[nn.Linear, int] | None = None,
    batch_name: str = "example batch",
) -> Activations:
    """The storages one forward of `batch` saves, per layer of `layers` (in forward order) and outside them.

    fused: (output head, chunk tokens) of model.fused_linear_cross_entropy: the loss is computed as training will.
    batch_name: what `batch` is, for the source line ("example batch", "first micro-batch")."""
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    params = [*model.parameters(), *model.buffers()]
    param_refs = {StorageWeakRef(p.untyped_storage()) for p in params}
    param_ids = {id(p) for p in params}
    from engine.offload.groups import is_weight_copy

    where: list[int | None] = [None]  # the layer running now
    stack: list[tuple[str, str]] = []
    seen: dict[StorageWeakRef, tuple[StorageWeakRef, int | None, Saved]] = {}
    order: list[tuple[int | None, Saved]] = []

    def pack(t: torch.Tensor) -> None:
        if t.layout != torch.strided:
            return None
        key = StorageWeakRef(t.untyped_storage())
        old = seen.get(key)
        if key in param_refs or (old is not None and not old[0].expired()):
            return None  # a parameter, or a storage recorded already (a view of it, saved again)
        entry = Saved(f"saved{len(order)}", t.untyped_storage().nbytes(), tuple(stack) if where[0] is not None else (),
                      weight_copy=is_weight_copy(t, param_ids))  # fmt: skip
        seen[key] = (key, where[0], entry)
        order.append((where[0], entry))
        return None  # dropped: the forward only has to be looked at, never differentiated

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(functools.partial(_enter_layer, where=where, i=i)))
        handles.append(layer.register_forward_hook(functools.partial(_leave_layer, where=where)))
        for name, sub in layer.named_modules():
            if name:
                handles.append(sub.register_forward_pre_hook(functools.partial(_push, stack=stack, name=name)))
                handles.append(sub.register_forward_hook(functools.partial(_pop, stack=stack)))
    devices = [device.index or 0] if device.type == "cuda" else []
    run = BatchLoss(loss_fn, takes_labels(model, loss_fn), float_dtype, is_causal_lm(model))  # as the engine's
    run.fused = fused
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), autocast or contextlib.nullcontext():
            with torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked):
                run(model, batch, device)
    finally:
        for h in handles:
            h.remove()
    per_layer: list[list[Saved]] = [[] for _ in layers]
    head: list[Saved] = []
    for i, entry in order:
        (head if i is None else per_layer[i]).append(entry)
    largest_head = max((e.nbytes for e in head), default=0)
    largest = max((e.nbytes for ly in per_layer for e in ly if not e.weight_copy), default=0)
    # the residual gradient flowing through a layer is the size of what the first layer's first op saves (its input)
    residual = next((e.nbytes for ly in per_layer[:1] for e in ly if not e.weight_copy), 0)
    logits = 2 * largest_head
    if fused is not None:
        logits = fused_loss_bytes(batch, fused, autocast is not None)
    return Activations(
        layers=per_layer,
        head=head,
        logits_transient=logits,
        backward_working=backward_working(1, residual, 1, largest),
        source=f"measured at the {batch_name}, shape {describe(batch)}, on {device.type}{attention(model)}",
    )


def fused_loss_bytes(batch: Any, fused: tuple[nn.Linear, int], autocast: bool) -> int:
    """What the fused linear cross-entropy holds for `batch`'s labels beyond the hidden states (its own figure):
    the head's matmul runs in autocast's half dtype, else in the head weight's."""
    head, chunk = fused
    _, _, labels = BatchLoss.split(batch)
    tokens = labels.numel() if isinstance(labels, torch.Tensor) else 0
    itemsize = 2 if autocast else head.weight.element_size()
    return fused_linear_cross_entropy_bytes(tokens, head.in_features, head.out_features, chunk, itemsize)


def _enter_layer(m: nn.Module, a: Any, *, where: list, i: int) -> None:
    where[0] = i


def _leave_layer(m: nn.Module, a: Any, o: Any, *, where: list) -> None:
    where[0] = None


def _push(m: nn.Module, a: Any, *, stack: list, name: str) -> None:
    stack.append((name, type(m).__name__))


def _pop(m: nn.Module, a: Any, o: Any, *, stack: list) -> None:
    if stack:
        stack.pop()


def _never_unpacked(x: Any) -> Any:
    raise RuntimeError("the plan's measuring forward is not differentiated")
