"""A model the user brings (HF transformers, their own nn.Module): the rules read from the model in hand, the
engine's full recompute of its layers, and `save_pretrained`.

The built-in GPT's `model.*` shape keys describe nothing with such a model and are refused (or, for an instance
of the built-in GPT, must agree with it); what the config rules check against `model.num_layers` for the built-in
GPT is checked against the discovered layer stacks (engine.offload.api), whose paths and counts the messages name.
"""

from __future__ import annotations

from typing import Any

import torch.utils.checkpoint
from torch import nn

from engine.config import ConfigError, ModelConfig
from engine.config.rules import BUILTIN_ONLY_KEYS
from engine.messages import recomputed_layer_count
from engine.models.gpt import GPT, recomputed_layers
from engine.offload.discovery import describe_stacks, find_layer_stacks

_HF_OFF = "gradient_checkpointing_disable"  # transformers 5 also calls it activation_checkpointing_disable


def hf_checkpointing(model: nn.Module) -> bool:
    """True when HF's `gradient_checkpointing_enable()` is on for `model` (its layers carry the flag)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def check(model: nn.Module, m: ModelConfig, written: frozenset[str] = frozenset()) -> None:
    """Before anything is allocated: `model.*` against the model in hand. ConfigError lists every shape key that
    would be ignored; ValueError names a combination with HF's gradient checkpointing that cannot act."""
    errors = _shape_key_errors(model, m, written)
    if errors:
        raise ConfigError(errors)
    if not hf_checkpointing(model):
        return
    if m.cpu_offloading or m.fine_grained_activation_offloading:
        key = "cpu_offloading" if m.cpu_offloading else "fine_grained_activation_offloading"
        raise ValueError(
            f"model.{key}=true: the model has HF gradient checkpointing on, whose layers keep only their inputs "
            "and recompute the rest, so there is nothing to offload and the two sets of hooks do not nest; call "
            f"model.{_HF_OFF}() or set model.{key}=false"
        )
    if m.recompute_granularity is not None:
        raise ValueError(
            f'model.recompute_granularity="{m.recompute_granularity}": the model has HF gradient checkpointing '
            f"on, which already recomputes its layers; set model.recompute_granularity=null or call "
            f"model.{_HF_OFF}()"
        )


def _builtin_shape(model: GPT) -> dict[str, int]:
    """What an instance of the built-in GPT was built with, as far as its modules tell."""
    shape = {"num_layers": len(model.layers), "hidden_size": model.embedding.embedding_dim}
    first = model.layers[0] if len(model.layers) else None
    if first is not None and hasattr(getattr(first, "attn", None), "num_heads"):
        shape["num_attention_heads"] = first.attn.num_heads
    if first is not None and hasattr(getattr(first, "mlp", None), "fc1"):
        shape["ffn_hidden_size"] = first.mlp.fc1.out_features
    return shape


def _shape_key_errors(model: nn.Module, m: ModelConfig, written: frozenset[str]) -> list[str]:
    """A built-in GPT shape key the user wrote (engine.config.written_keys), whatever its value: refused."""
    given = {k: getattr(m, k) for k in BUILTIN_ONLY_KEYS if f"model.{k}" in written}
    shape = _builtin_shape(model) if isinstance(model, GPT) else {}
    errors = []
    for key, value in given.items():
        shown = f'"{value}"' if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else value
        if key in shape and shape[key] == value:
            continue  # describes the built-in GPT passed in, correctly
        if key in shape:
            errors.append(f"model.{key}={shown}: the GPT passed to engine.initialize has {key} {shape[key]}; "
                          f"set model.{key}={shape[key]} or remove it")  # fmt: skip
        else:
            errors.append(f"model.{key}={shown}: describes the built-in GPT, and engine.initialize was given a model "
                          "of its own, whose layers and widths come from the model itself (checked after layer "
                          f"discovery); remove model.{key}")  # fmt: skip
    return errors


def prepare(model: nn.Module, m: ModelConfig, wrap: bool = True) -> str | None:
    """Applies `recompute_granularity="full"` to the layers of the model in hand (model.recompute_num_layers of
    them after the offloaded ones, or all); returns a description of the layer stacks it wrapped, or None. Raises
    ValueError naming the key and the fix where it cannot act (wrap=False: only that check; an "auto" number of
    offloaded layers is not known yet, and the count is checked once it is)."""
    if m.recompute_granularity != "full":
        return None
    if m.fine_grained_activation_offloading:
        raise ValueError(
            'model.recompute_granularity="full": a recomputed layer keeps only its inputs, so its sub-modules have '
            "nothing to offload; set model.recompute_granularity=null or model.fine_grained_activation_offloading=false"
        )
    try:
        stacks = find_layer_stacks(model, m.cpu_offloading_layers_path)
    except ValueError as e:
        raise ValueError(f'model.recompute_granularity="full" wraps each transformer layer, but {e}') from None
    every = [layer for _, layers in stacks for layer in layers]  # forward order, as offloading counts them
    if not wrap and "auto" in (m.cpu_offloading_num_layers, m.recompute_num_layers):
        return describe_stacks(stacks)
    offloaded = int(m.cpu_offloading_num_layers) if m.cpu_offloading else 0
    count = m.recompute_num_layers
    if count is not None and offloaded + count > len(every):
        raise ValueError(
            f"model.recompute_num_layers={count}: "
            f"{recomputed_layer_count(count, offloaded if m.cpu_offloading else None, len(every))}"
        )
    for i in recomputed_layers(len(every), offloaded, count) if wrap else ():
        recompute(every[i])
    return describe_stacks(stacks)


class RecomputedModule(nn.Module):
    """Put in front of a layer's class: its forward runs under torch.utils.checkpoint (non-reentrant), keeping its
    inputs and recomputing the rest in backward. A class, not an instance attribute, so a deepcopy (an EMA copy)
    runs its own weights."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = super().forward
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)


_RECOMPUTED: dict[type, type] = {}


def recompute(layer: nn.Module) -> None:
    """`layer` runs under recompute from now on; its parameters, state_dict keys and hooks are unchanged."""
    cls = type(layer)
    if issubclass(cls, RecomputedModule):
        return
    if cls not in _RECOMPUTED:
        # _wraps: layer discovery (engine.offload.discovery) counts it as the block it wraps
        _RECOMPUTED[cls] = type(f"Recomputed{cls.__name__}", (RecomputedModule, cls), {"_wraps": cls})
    layer.__class__ = _RECOMPUTED[cls]


def save_pretrained(model: nn.Module, save_dir: str, **kwargs: Any) -> str:
    """The model's own `save_pretrained` (HF: config.json and safetensors weights, loadable by from_pretrained)."""
    save = getattr(model, "save_pretrained", None)
    if save is None:
        raise ValueError(
            f"save_pretrained needs a transformers PreTrainedModel (or a model with save_pretrained); "
            f"{type(model).__name__} has none: use eng.save_checkpoint(dir) or torch.save(eng.module.state_dict())"
        )
    save(save_dir, **kwargs)
    return str(save_dir)
