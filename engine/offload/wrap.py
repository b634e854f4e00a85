"""Wiring: turn modules into activation-offload modules, mark the others, and undo it all.

An offloaded module keeps its identity: its class is swapped for a subclass `Offloaded<Name>` of
`ActivationOffloadModule` and its own class (as torch.nn.utils.parametrize does), so `isinstance` checks,
parameter names and state_dict keys are unchanged and checkpoints load either way. Its forward runs the
original forward inside saved-tensor hooks that hand what autograd saves to the session. Modules that take
part without offloading (the layers after the first k) only get forward hooks that mark where backward is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.offload.session import OffloadSession

_SUBCLASSES: dict[type, type] = {}


class ActivationOffloadModule(nn.Module):
    """Mixin put in front of an offloaded module's class; `_offload_unit` is (session, unit index)."""

    _offload_unit: tuple[OffloadSession, int]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, so nothing to do at all
            return super().forward(*args, **kwargs)
        session, unit = self._offload_unit
        group = session.begin(unit, offloads=True)
        with torch.autograd.graph.saved_tensors_hooks(group.pack, _unpack):
            out = super().forward(*args, **kwargs)
        group.end_forward()
        session.mark_backward(out, unit)
        return out


def _unpack(packed: object) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):  # kept on the device
        return packed
    return packed.group.unpack(packed)


def _offload_class(cls: type) -> type:
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"Offloaded{cls.__name__}", (ActivationOffloadModule, cls), {})
    return _SUBCLASSES[cls]


class OffloadHandle:
    """What `apply_*` returns: metrics and `remove()`. Hooks and class swaps are undone by `remove()`."""

    def __init__(
        self, session: OffloadSession | None, offloaded: list[nn.Module], unit_paths: list[str] | None = None
    ) -> None:
        self.session = session
        self.offloaded = offloaded
        self.unit_paths = unit_paths or []  # the layer stack each unit belongs to, by unit index
        self._classes: list[tuple[nn.Module, type]] = []
        self._hooks: list[Any] = []

    def host_bytes(self) -> int:
        """Bytes of saved tensors held in host memory now (the end of forward is the high point)."""
        return self.session.held_bytes if self.session is not None else 0

    def peak_host_bytes(self) -> int:
        """The most bytes of saved tensors held in host memory at once so far (at the end of a forward)."""
        return self.session.peak_held_bytes if self.session is not None else 0

    def pool_bytes(self) -> int:
        """Host memory the pool has allocated (pinned on CUDA); flat after the first iteration."""
        return self.session.pool.allocated_bytes if self.session is not None else 0

    def offload(self, module: nn.Module, unit: int) -> None:
        self._classes.append((module, type(module)))
        module.__class__ = _offload_class(type(module))
        module._offload_unit = (self.session, unit)

    def mark(self, module: nn.Module, unit: int) -> None:
        session = self.session

        def before(mod: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled():
                session.begin(unit, offloads=False)

        def after(mod: nn.Module, args: Any, out: Any) -> None:
            if torch.is_grad_enabled():
                session.mark_backward(out, unit)

        self._hooks += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def remove(self) -> None:
        for module, cls in reversed(self._classes):
            module.__class__ = cls
            del module._offload_unit
        for hook in self._hooks:
            hook.remove()
        self._classes, self._hooks, self.offloaded = [], [], []
        if self.session is not None:
            self.session.close()
