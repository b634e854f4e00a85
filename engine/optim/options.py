"""Validation of HybridDeviceOptimizer's options: each bad value raises ValueError naming the option,
its config key, the value and the valid range, so the optimizer is safe to build on its own."""

from __future__ import annotations

import numbers

# constructor argument -> config key a user of the engine would set
CONFIG_KEY = {
    "offload_fraction": "optimizer.optimizer_offload_fraction",
    "optimizer": "optimizer.optimizer",
    "lr": "optimizer.lr",
    "weight_decay": "optimizer.weight_decay",
    "eps": "optimizer.adam_eps",
    "momentum": "optimizer.sgd_momentum",
    "cpu_threads": "optimizer.cpu_optimizer_threads",
    "speculation_buffer_mb": "optimizer.speculation_buffer_mb",
    "delayed_param_update_warmup": "optimizer.delayed_param_update_warmup",
}


def _fail(name: str, value: object, valid: str) -> ValueError:
    key = CONFIG_KEY.get(name)
    where = f"{name} ({key})" if key else name
    return ValueError(f"{where}={value!r} is invalid: expected {valid}")


def number_in(
    name: str, value: object, lo: float, hi: float | None, lo_open: bool = False, hi_open: bool = False
) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (hi is None or (value < hi if hi_open else value <= hi))
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {'inf' if hi is None else hi}{')' if hi_open or hi is None else ']'}"
        raise _fail(name, value, f"a number in {rng}")
    return float(value)


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, value, "True or False")
    return value


def choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise _fail(name, value, f"one of {', '.join(map(repr, choices))}")
    return value  # type: ignore[return-value]


def betas(value: object) -> tuple[float, float]:
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise _fail("betas", value, "a pair (beta1, beta2) with each in [0, 1)")
    return number_in("betas[0]", value[0], 0.0, 1.0, hi_open=True), number_in(
        "betas[1]", value[1], 0.0, 1.0, hi_open=True
    )


def threads(value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _fail("cpu_threads", value, "None (physical cores minus one) or an integer >= 1")
    return value


def whole_number(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _fail(name, value, "an integer >= 0")
    return value
