"""How one micro-batch meets the model: where its tensors go, where `labels` go, and how the output becomes the loss.

A micro-batch is `(inputs, labels)`, a dict of keyword arguments (HF's `input_ids`, `attention_mask`, `labels`,
...), or one tensor. Without a `loss_fn`, `labels` are passed to the model when its forward takes them: it names
`labels` or takes `**kwargs` (HF models compute their own loss from them, shifting as they must); the signature is
read through torch.compile's wrapper (`_orig_mod`) and functools wrappers (`__wrapped__`). With a `loss_fn` they
go to `loss_fn` only (the model would compute a second loss, thrown away), unless its forward requires them.

A torch criterion as `loss_fn` (an `nn.CrossEntropyLoss()` instance, `F.cross_entropy`) gets the logits: the
output's `.logits` for an HF output, flattened to [tokens, classes] against integer labels; for a causal LM the
logits and labels shifted as the model's own loss shifts them (labels are the input ids, position t predicts t+1).

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
from engine.models.linear_cross_entropy import model_loss as fused_loss

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


def inner_module(model: nn.Module) -> nn.Module:
    """The module whose forward really runs: through torch.compile's OptimizedModule and DDP's wrapper."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None) if type(model).__name__ == "DistributedDataParallel" else None
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def labels_parameter(model: nn.Module) -> inspect.Parameter | None:
    """The forward's `labels` parameter, a `**kwargs` parameter (which takes them), or None. The signature is read
    through compiled and wrapped modules (inspect follows functools' `__wrapped__`)."""
    try:
        params = inspect.signature(inner_module(model).forward).parameters
    except (TypeError, ValueError):  # a builtin or C++ forward without a signature
        return None
    if "labels" in params:
        return params["labels"]
    return next((p for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)


def takes_labels(model: nn.Module, loss_fn: Any = None) -> bool:
    """True when `labels` go to the model: it takes them and computes its own loss, or a loss_fn is given and its
    forward requires them (a `labels` argument without a default)."""
    param = labels_parameter(model)
    if param is None:
        return False
    if loss_fn is None:
        return True
    return param.name == "labels" and param.default is inspect.Parameter.empty


def is_criterion(loss_fn: Any) -> bool:
    """A torch loss: an `nn` loss module (`nn.CrossEntropyLoss()`) or a `torch.nn.functional` function."""
    return isinstance(loss_fn, nn.modules.loss._Loss) or getattr(loss_fn, "__module__", "") == "torch.nn.functional"


def is_causal_lm(model: nn.Module) -> bool:
    """An HF causal LM (its own loss shifts the labels): its class is one transformers maps for causal LM."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return type(inner_module(model)).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def fused_loss_head(model: nn.Module, in_hand: bool, loss_fn: Any, chunk_tokens: int) -> tuple[nn.Module, int]:
    """model.fused_linear_cross_entropy: (the output head, chunk tokens) BatchLoss.fused computes the loss from
    (engine.models.linear_cross_entropy); ValueError naming the key where it cannot act."""
    from engine.models.linear_cross_entropy import output_head

    if not in_hand or loss_fn is not None:
        why = "the built-in GPT computes its own loss" if not in_hand else "loss_fn takes the whole logits"
        raise ValueError(f"model.fused_linear_cross_entropy=true acts on an HF causal LM's own loss, and {why}; "
                         "set it to false")  # fmt: skip
    model = inner_module(model)
    return output_head(model, is_causal_lm(model)), chunk_tokens


class BatchLoss:
    """Runs one micro-batch through `model` and returns its scalar loss (see the module docstring)."""

    def __init__(self, loss_fn: LossFn | None, passes_labels: bool, float_dtype: torch.dtype | None = None,
                 shifts: bool = False) -> None:  # fmt: skip
        self.loss_fn, self.passes_labels, self.float_dtype = loss_fn, passes_labels, float_dtype
        self.shifts = shifts  # a criterion as loss_fn on a causal LM: shift as the model's own loss does
        self.fused: tuple[nn.Module, int] | None = None  # (output head, chunk tokens): fused linear cross-entropy

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
        if self.fused is not None and labels is not None:  # the head returns the loss; labels stay out
            head, chunk = self.fused
            return fused_loss(inner_module(model), head, labels, chunk, lambda: model(*args, **kwargs))
        if self.passes_labels and labels is not None:
            kwargs["labels"] = labels
        try:
            out = model(*args, **kwargs)
        except TypeError as e:
            if "labels" not in kwargs or "'labels'" not in str(e):
                raise
            raise TypeError(
                f"the model's forward takes **kwargs, so the batch's `labels` were passed to it, and inside it "
                f"{str(e).splitlines()[0]}; pass labels on to a forward that takes them, or pass "
                "loss_fn=lambda output, labels: <scalar loss> to engine.initialize (labels then stay out of the model)"
            ) from e
        return self.loss(out, labels)

    def loss(self, out: Any, labels: Any) -> torch.Tensor:
        if self.loss_fn is not None and is_criterion(self.loss_fn):
            return _scalar(self.loss_fn(*_criterion_inputs(out, labels, self.shifts)), "loss_fn returned")
        if self.loss_fn is not None:
            try:
                return _scalar(self.loss_fn(out, labels), "loss_fn returned")
            except TypeError as e:
                if isinstance(out, torch.Tensor) or type(out).__name__ not in str(e):
                    raise
                raise TypeError(f"loss_fn(output, labels) got the model's {type(out).__name__} and failed ("
                                f"{str(e).splitlines()[0]}); its logits are output.logits: "
                                "loss_fn=lambda output, labels: criterion(output.logits, labels)") from e  # fmt: skip
        found = loss_in(out)
        if found is not None:
            return found
        if _logits_and_classes(out, labels):
            return gpt_loss(out, labels)
        raise ValueError(f"{_describe(out, labels)}; {_HOW}")


def _criterion_inputs(out: Any, labels: Any, shifts: bool) -> tuple[torch.Tensor, Any]:
    """(logits, labels) for a torch criterion: an HF output's `.logits`; [..., classes] against integer labels
    [...] flattened to [N, classes] and [N]; under `shifts` position t's logits against label t+1."""
    logits = out
    if not isinstance(out, torch.Tensor):
        logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"loss_fn is a torch criterion, which takes logits, and the model returned "
                            f"{type(out).__name__} without a .logits tensor; "
                            "pass loss_fn=lambda output, labels: <scalar loss>")  # fmt: skip
    integer = isinstance(labels, torch.Tensor) and not labels.is_floating_point()
    if integer and logits.dim() >= 3 and labels.shape == logits.shape[:-1]:
        if shifts:
            logits, labels = logits[..., :-1, :], labels[..., 1:]
        return logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1)
    return logits, labels


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
