"""The CPU pass in the arithmetic of the GPU's fused AdamW, so that offloading a parameter changes none of its bits.

Why: the GPU-stepped part steps with torch's fused CUDA AdamW, the C pass by default in torch's single-tensor
arithmetic; the two differ in the last bit of a fraction of elements, and with bf16 weights such a difference in
the fp32 master flips a weight at a rounding boundary now and then, which a run carries as noise (on the H200,
~1e-3 on a loss of 2.25 after 200 iterations, against 0 for activation offload). Computing the CPU step in the
fused kernel's own arithmetic (`fused_adamw_f32_device` in csrc/fused_adamw.c) makes a run at any offload fraction
step every parameter as the run without offload does.

torch has shipped more than one fused arithmetic (narrow_kernel.Math). `find` runs each candidate of the C pass
against torch's fused AdamW on the device on a probe, once per device, and keeps the one that matches bit for bit;
None (not CUDA, no C pass, no match: the last said in one line) keeps the single-tensor arithmetic. The bias
corrections are the fused kernel's: 1 - beta^step computed on the device by torch.pow from a float32 step count,
for a table of steps at a time (one host sync per 4096 steps).

Bytes: none beyond a few scalars per (betas, step block).
"""

from __future__ import annotations

import functools
import logging
import threading

import torch

from engine.optim import fused_kernel, narrow_kernel
from engine.optim.adam_math import Hyper
from engine.optim.narrow_kernel import CANDIDATES, DOUBLE, FLOAT, FLOAT_UNFUSED, Math

_log = logging.getLogger(__name__)
CODE = {FLOAT: 1, FLOAT_UNFUSED: 2, DOUBLE: 3}  # fused_adamw_f32_device's `math`
_TABLE = 4096  # steps of bias corrections fetched from the device at once


class DeviceArith:
    """One fused arithmetic (`math`) with the device's bias corrections, read from `device` in tables."""

    def __init__(self, math: Math, device: torch.device) -> None:
        self.math = math
        self.code = CODE[math]
        self.device = device
        self._tables: dict[tuple[float, float, int], list[tuple[float, float]]] = {}
        self._lock = threading.Lock()  # the CPU part's worker threads ask at once

    def bias(self, beta1: float, beta2: float, step: int) -> tuple[float, float]:
        """(1 - beta1**step, sqrt(1 - beta2**step)) as torch's fused kernel computes them on the device."""
        key = (beta1, beta2, (step - 1) // _TABLE)
        with self._lock:
            table = self._tables.get(key)
            if table is None:
                table = self._tables[key] = _bias_table(beta1, beta2, key[2] * _TABLE + 1, self.math, self.device)
        return table[(step - 1) % _TABLE]

    def scalars(self, h: Hyper, step: int, inv_scale: float, coef: float) -> tuple[float, ...]:
        """fused_kernel.adamw_slice's `device` scalars for group hyperparameters h at optimizer step `step` (>= 1)."""
        bc1, bc2_sqrt = self.bias(h.beta1, h.beta2, step)
        return (inv_scale, coef, self.code, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, bc1, bc2_sqrt)


def _bias_table(beta1: float, beta2: float, first: int, math: Math, device: torch.device) -> list[tuple[float, float]]:
    """Bias corrections for steps first .. first + _TABLE - 1 (narrow_kernel.bias_corrections on the device)."""
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):  # not behind the model's work
        steps = torch.arange(first, first + _TABLE, dtype=torch.float32, device=device)
        both = torch.stack(narrow_kernel.bias_corrections(beta1, beta2, steps, math), 1).cpu()
    return [(float(a), float(b)) for a, b in both.tolist()]


@functools.cache
def find(device: torch.device) -> DeviceArith | None:
    """The C pass's arithmetic that gives torch's fused AdamW's bits on `device`, or None (module docstring)."""
    lib = fused_kernel.load()
    if device.type != "cuda" or lib is None:
        return None
    n = 1 << 18
    start, want = ([t.cpu() for t in ts] for ts in narrow_kernel.probe_case(device, n))
    for math in CANDIDATES:
        arith = DeviceArith(math, device)
        p, g, m, v = (t.clone() for t in start)
        for step in narrow_kernel.PROBE_STEPS:
            fused_kernel.adamw_slice(lib, 0, n, p, m, v, g, None, p, m, v, None, None,
                                     device=arith.scalars(narrow_kernel.PROBE_HYPER, step, 1.0, 1.0))  # fmt: skip
        pairs = zip((p, m, v), (want[0], want[2], want[3]), strict=True)
        if all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in pairs):
            return arith
    _log.warning("torch's fused AdamW on %s computes none of the known arithmetics; the CPU-stepped part keeps "
                 "torch's single-tensor arithmetic (offloaded parameters may differ from the GPU's in the last bit)",
                 device)  # fmt: skip
    return None
