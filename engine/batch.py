"""How one micro-batch meets the model: where its tensors go, where `labels` go, and how the output becomes the loss.

A micro-batch is `(inputs, labels)`, a dict of keyword arguments (HF's `input_ids`, `attention_mask`, `labels`,
...), or one tensor. `labels` are passed to the model when its forward takes a `labels` argument (HF models:
they compute their own loss from them, shifting as they must), and are given to `loss_fn` either way.

Without a `loss_fn` the loss is read from the output: a scalar tensor, a `ModelOutput` or dict with a `loss`,
or a tuple whose first element is a scalar (HF's `return_dict=False`). Failing that, logits [..., classes]
beside integer labels [...] get the default loss (cross-entropy of the logits against the labels as given,
the built-in GPT's: its data's labels are the next tokens). Anything else is an error saying what came back.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from engine.models.gpt import gpt_loss

LossFn = Callable[[Any, Any], torch.Tensor]
_HOW = "pass loss_fn=lambda output, labels: <scalar loss> to engine.initialize"


def to_device(batch: Any, device: torch.device, float_dtype: torch.dtype | None = None) -> Any:
    """The batch's tensors on `device`; floating-point ones also cast to `float_dtype` (the weights' dtype
    under half weights) when it is given. Integer tensors (token ids, masks) keep their dtype."""
    if isinstance(batch, torch.Tensor):
        if float_dtype is not None and batch.is_floating_point():
            return batch.to(device, float_dtype, non_blocking=True)
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device, float_dtype) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device, float_dtype) for v in batch)
    return batch


def takes_labels(model: nn.Module) -> bool:
    """True when the model's forward names a `labels` argument (HF models), so it can compute its own loss."""
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a builtin or C++ forward without a signature
        return False


class BatchLoss:
    """Runs one micro-batch through `model` and returns its scalar loss (see the module docstring)."""

    def __init__(self, loss_fn: LossFn | None, passes_labels: bool, float_dtype: torch.dtype | None = None) -> None:
        self.loss_fn, self.passes_labels, self.float_dtype = loss_fn, passes_labels, float_dtype

    @staticmethod
    def split(batch: Any) -> tuple[tuple, dict, Any]:
        """(positional inputs, keyword inputs, labels or None) of a micro-batch."""
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return (batch[0],), {}, batch[1]
        if isinstance(batch, Mapping):
            kwargs = dict(batch)
            return (), kwargs, kwargs.pop("labels", None)
        return (batch,), {}, None

    def __call__(self, model: nn.Module, batch: Any, device: torch.device) -> torch.Tensor:
        args, kwargs, labels = self.split(batch)
        args, kwargs = to_device((args, kwargs), device, self.float_dtype)
        labels = to_device(labels, device)  # uncast: a float target keeps its precision
        if self.passes_labels and labels is not None:
            kwargs["labels"] = labels
        return self.loss(model(*args, **kwargs), labels)

    def loss(self, out: Any, labels: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return _scalar(self.loss_fn(out, labels), "loss_fn returned")
        found = loss_in(out)
        if found is not None:
            return found
        if _logits_and_classes(out, labels):
            return gpt_loss(out, labels)
        raise ValueError(f"{_describe(out, labels)}; {_HOW}")


def loss_in(out: Any) -> torch.Tensor | None:
    """The loss an output carries: a scalar tensor, `.loss` / `["loss"]`, or a tuple's scalar first element."""
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 and out.is_floating_point() else None
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)  # ModelOutput is a Mapping
    if isinstance(loss, torch.Tensor):
        return _scalar(loss, f"the model's {type(out).__name__}.loss is")
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) and out[0].dim() == 0:
        return out[0]
    return None


def _logits_and_classes(out: Any, labels: Any) -> bool:
    """Logits [..., vocab] beside integer class labels [...]: the shapes the default cross-entropy takes."""
    return (isinstance(out, torch.Tensor) and out.is_floating_point() and out.dim() >= 2
            and isinstance(labels, torch.Tensor) and not labels.is_floating_point()
            and labels.shape == out.shape[:-1])  # fmt: skip


def _scalar(loss: Any, what: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        shape = f"a tensor of shape {list(loss.shape)} ({loss.dtype})" if isinstance(loss, torch.Tensor) else (
            type(loss).__name__)  # fmt: skip
        raise ValueError(f"{what} {shape}, not a floating-point scalar loss; reduce it to one (e.g. .mean())")
    return loss


def _describe(out: Any, labels: Any) -> str:
    """One clause saying what the model returned and why it is not a loss."""
    name = type(out).__name__
    if isinstance(out, torch.Tensor):
        if labels is None:
            return f"the model returned a tensor of shape {list(out.shape)}: not a scalar loss, and no labels came"
        shape = list(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        return (
            f"the model returned a tensor of shape {list(out.shape)}: not a scalar loss, nor logits [..., classes] "
            f"for the integer labels of shape {shape} (the default cross-entropy)"
        )
    has_loss = isinstance(out, Mapping) and "loss" in out or hasattr(out, "loss")
    if has_loss:
        hint = "the batch has no `labels` for the model to compute it from" if labels is None else (
            "its forward does not take `labels`")  # fmt: skip
        return f"the model returned {name} with loss=None ({hint})"
    return f"the model returned {name}, which carries no loss"
