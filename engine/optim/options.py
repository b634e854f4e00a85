"""HybridDeviceOptimizer's options as one object, validated once where it is made: each bad value raises
ValueError naming the option, its config key, the value and the valid range, so the optimizer is safe to build
on its own (the engine builds `HybridOptions` from the config; tests and tools build it directly)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from engine.messages import unscaled_fp16_moments
from engine.optim import blockwise
from engine.optim.delayed import DEFAULT_WARMUP

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
    "gpu_assist": "optimizer.cpu_offload_gpu_assist",
    "delayed_param_update": "optimizer.delayed_param_update",
    "store_param_remainders": "optimizer.store_param_remainders",
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


# the moments' storage: torch dtypes, or blockwise.CODES (torch.uint8) for the block-wise 8-bit form; fp16 is
# listed so that HybridOptions refuses it with its reason (messages.unscaled_fp16_moments) instead of as unknown
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, blockwise.CODES)
STATE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
               blockwise.NAME: blockwise.CODES}  # the config's names  # fmt: skip
_FLAGS = ("overlap_cpu_optimizer_d2h_h2d", "pin_cpu_grads", "pin_cpu_params", "use_torch_optimizer_for_cpu_offload",
          "pin_cpu_threads", "accumulate_grads_in_fp32", "delayed_param_update", "gpu_assist",
          "store_param_remainders")  # fmt: skip


@dataclass(frozen=True)
class HybridOptions:
    """Everything HybridDeviceOptimizer is told besides its parameters (per-group lr, weight_decay, eps and betas
    in the param groups override the first five). cpu_threads None: the cores this process may use, minus one."""

    lr: float
    optimizer: str = "adam"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    offload_fraction: float = 0.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    use_torch_optimizer_for_cpu_offload: bool = False
    cpu_threads: int | None = None
    pin_cpu_threads: bool = False
    accumulate_grads_in_fp32: bool = True
    delayed_param_update: bool = False
    delayed_param_update_warmup: int = DEFAULT_WARMUP
    gpu_assist: bool = False
    speculation_buffer_mb: int = 2048
    exp_avg_dtype: torch.dtype = torch.float32  # both parts' moments (precision-aware optimizer); STATE_DTYPES:
    # torch.uint8 the block-wise 8-bit form (blockwise.py)
    exp_avg_sq_dtype: torch.dtype = torch.float32
    store_param_remainders: bool = False  # both parts' fp32 master as bf16 weight + int16 remainder

    def __post_init__(self) -> None:
        choice("optimizer", self.optimizer, ("adam", "sgd"))
        number_in("offload_fraction", self.offload_fraction, 0.0, 1.0)
        for name in _FLAGS:
            flag(name, getattr(self, name))
        whole_number("delayed_param_update_warmup", self.delayed_param_update_warmup)
        whole_number("speculation_buffer_mb", self.speculation_buffer_mb)
        threads(self.cpu_threads)
        number_in("lr", self.lr, 0.0, None)
        object.__setattr__(self, "betas", betas(self.betas))
        number_in("eps", self.eps, 0.0, None, lo_open=True)
        number_in("weight_decay", self.weight_decay, 0.0, None)
        number_in("momentum", self.momentum, 0.0, 1.0)
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            dtype = getattr(self, name)
            choice(name, dtype, STATE_DTYPES)
            if dtype != torch.float32 and (self.optimizer != "adam" or self.use_torch_optimizer_for_cpu_offload
                                           or self.gpu_assist):  # fmt: skip
                raise ValueError(f"{name} (optimizer.{name})={dtype} is the engine's own AdamW's: set "
                                 "optimizer.optimizer='adam', use_torch_optimizer_for_cpu_offload=false and "
                                 f"cpu_offload_gpu_assist=false, or {name}='fp32'")  # fmt: skip
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, name) == torch.float16:
                raise ValueError(f"{name} (optimizer.{name})=torch.float16: "
                                 f"{unscaled_fp16_moments(name.removesuffix('_dtype'), 'torch.bfloat16')}")  # fmt: skip
        if self.store_param_remainders:
            clash = [k for k, on in (("optimizer='sgd'", self.optimizer != "adam"),
                                     ("use_torch_optimizer_for_cpu_offload", self.use_torch_optimizer_for_cpu_offload),
                                     ("gpu_assist", self.gpu_assist)) if on]  # fmt: skip
            if clash:
                raise ValueError(f"store_param_remainders (optimizer.store_param_remainders)=True is the engine's "
                                 f"own AdamW's, stepping the model's weights in place; it does not combine with "
                                 f"{clash[0]}: set one of them back")  # fmt: skip
        if self.delayed_param_update and self.offload_fraction == 0:
            raise ValueError("delayed_param_update (optimizer.delayed_param_update) delays the CPU-stepped part's "
                             "update, and offload_fraction=0 steps nothing on the CPU; set "
                             "optimizer.optimizer_offload_fraction > 0 or delayed_param_update=False")  # fmt: skip
        if self.delayed_param_update and self.gpu_assist:
            raise ValueError("delayed_param_update (optimizer.delayed_param_update) and gpu_assist "
                             "(optimizer.cpu_offload_gpu_assist) do not combine: the assist writes the weights "
                             "in place; set one of them to False")  # fmt: skip

    def defaults(self) -> dict:
        """torch.optim's defaults for the param groups."""
        return dict(lr=float(self.lr), betas=self.betas, eps=float(self.eps), weight_decay=float(self.weight_decay),
                    momentum=float(self.momentum))  # fmt: skip
