"""The one parameter grouping every optimizer of the engine is built over (the engine's, megatron-core's, the
benchmarks'): weight decay on matrices, none on biases and norm weights, Megatron's rule.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def decays(name: str, p: nn.Parameter) -> bool:
    """Weight decay applies to matrices, not to biases and norm weights (1-D): Megatron's rule and ours."""
    return p.dim() >= 2 and name.rsplit(".", 1)[-1] != "bias"


def named_parameter_groups(
    model: nn.Module, model_parameters: Iterable[nn.Parameter] | None, weight_decay: float, *, named: bool = True
) -> list[dict]:
    """The one parameter grouping: two groups, `decays` with weight_decay and the rest without, of
    (name, parameter) pairs (the engine's optimizers key state by name) or, with named=False, bare tensors."""
    chosen = None if model_parameters is None else {id(p) for p in model_parameters}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or (chosen is not None and id(p) not in chosen):
            continue
        (decay if decays(name, p) else no_decay).append((name, p) if named else p)
    return [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]
