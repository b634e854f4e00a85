"""Weights readable after a step: reads of the model wait for updates still on their way.

With the optimizer offloaded and overlap on, `train_batch` returns while the CPU still steps some layers and
their new weights are copied back; the engine's next forward waits per layer on its own. Anything else that
reads the model waits here, with no call from the user:
  - `model.state_dict()`, of the model or any sub-module (a pre-hook on every module): checkpoints, EMA,
    HF's `save_pretrained`;
  - a forward of the whole model outside the engine (a forward pre-hook on the root): evaluation;
  - `eng.module` (the Engine's property).
Not covered: a raw tensor kept across steps (`w = model.lm_head.weight` read later, `named_parameters()`
consumed after the step); call `eng.synchronize()` before reading those.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class ReadableWeights:
    """The hooks above; `pending` is set after each step and cleared by the first wait."""

    def __init__(self, model: nn.Module, synchronize: Callable[[], None]) -> None:
        self.pending = False
        self.inside_engine = False  # the engine's own forward waits per layer, never for the whole step
        self._synchronize = synchronize
        self._handles = [m.register_state_dict_pre_hook(self._before_read) for m in model.modules()]
        self._handles.append(model.register_forward_pre_hook(self._before_forward))

    def wait(self) -> None:
        if self.pending:
            self.pending = False
            self._synchronize()

    def _before_read(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self.wait()

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if not self.inside_engine:
            self.wait()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
