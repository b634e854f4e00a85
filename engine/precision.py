"""Mixed precision: the autocast context for fp32 weights and the fp16 loss scaler."""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def autocast(device: torch.device, precision: str, params_dtype: str) -> contextlib.AbstractContextManager:
    """Autocast to the half dtype when weights are fp32; half weights already compute in half."""
    if precision == "fp32" or params_dtype == "half":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


class LossScaler:
    """fp16 loss scaling: static when `static_scale` is set, else dynamic (halve on overflow,
    double after `window` clean steps). bf16 and fp32 use scale 1 and never skip."""

    def __init__(self, enabled: bool, static_scale: float | None, initial_scale: float, window: int) -> None:
        self.enabled = enabled
        self.dynamic = enabled and static_scale is None
        self.scale = (static_scale or initial_scale) if enabled else 1.0
        self.window = window
        self.clean_steps = 0

    def update(self, stepped: bool) -> None:
        if not self.dynamic:
            return
        if not stepped:
            self.scale = max(self.scale / 2.0, 1.0)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps % self.window == 0:
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
