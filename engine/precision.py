"""Mixed precision: the autocast context for fp32 weights, the fp16 loss scaler, and FP8 through Transformer Engine."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

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


# --- FP8 through Transformer Engine (train.fp8): the recipe from Megatron's keys, the forward's context ----------

FP8_MIN_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}
FP8_RECIPE_CLASSES = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling",
                      "blockwise": "Float8BlockScaling", "mxfp8": "MXFP8BlockScaling"}  # fmt: skip
DELAYED_ONLY = {"fp8_margin": 0, "fp8_amax_history_len": 1, "fp8_amax_compute_algo": "most_recent"}  # key: default


def fp8_recipe_kwargs(t: Any) -> tuple[str, dict[str, Any]]:
    """(TE recipe class name, its keyword arguments) from `train.fp8*`; the format as Format's member name.
    Kept free of TE so the mapping is checked where TE is not installed."""
    kwargs: dict[str, Any] = {"fp8_format": t.fp8.upper()}
    if t.fp8_recipe == "delayed":
        kwargs.update(margin=t.fp8_margin, amax_history_len=t.fp8_amax_history_len,
                      amax_compute_algo=t.fp8_amax_compute_algo)  # fmt: skip
    return FP8_RECIPE_CLASSES[t.fp8_recipe], kwargs


def fp8_recipe(t: Any) -> Any:
    """The Transformer Engine recipe object `train.fp8*` describe (needs TE)."""
    from transformer_engine.common import recipe

    name, kwargs = fp8_recipe_kwargs(t)
    kwargs["fp8_format"] = getattr(recipe.Format, kwargs["fp8_format"])
    return getattr(recipe, name)(**kwargs)


def fp8_capability_problem(recipe_name: str, capability: tuple[int, int]) -> str | None:
    """Why the GPU of `capability` cannot run `recipe_name`, or None."""
    need = FP8_MIN_CAPABILITY[recipe_name]
    if capability >= need:
        return None
    where = "Blackwell (compute capability 10.0+)" if need >= (10, 0) else f"compute capability {need[0]}.{need[1]}+"
    fix = 'set train.fp8_recipe="delayed" or "tensorwise"' if recipe_name in ("mxfp8", "blockwise") and capability >= (
        8, 9) else "set train.fp8=null"  # fmt: skip
    return (f"the {recipe_name} FP8 recipe needs a GPU of {where}; this one is {capability[0]}.{capability[1]}; "
            f"{fix}")  # fmt: skip


FP8_WEIGHT_COPY_BYTES = 2  # per layer weight element: its FP8 copy and, on Hopper, the copy's transpose


def fp8_weight_cache_bytes(layer_weight_elements: int) -> int:
    """GPU bytes TE holds across micro-batches for the FP8 weight cache the engine turns on (`first_microbatch`):
    every TE layer weight's FP8 copy with its transpose (Hopper's FP8 GEMMs take only the TN layout, so backward
    needs the transpose; MXFP8 keeps two scalings instead: also 2 B). Without the cache TE casts them again in
    each micro-batch's forward and saves the same bytes for backward."""
    return FP8_WEIGHT_COPY_BYTES * layer_weight_elements


class Fp8Forward:
    """A fresh TE FP8 context per forward (TE's is a one-shot generator context): FP8 GEMMs in every TE layer the
    forward runs; the backward runs outside it, as TE wants. The context holds no memory: the delayed recipe's
    amax histories and scales live in TE's modules (a few floats per GEMM), the FP8 weight cache too
    (fp8_weight_cache_bytes)."""

    def __init__(self, t: Any) -> None:
        import torch.distributed as torch_dist
        import transformer_engine.pytorch as te

        self._te, self._recipe = te, fp8_recipe(t)
        # data-parallel ranks agree on the scales, as Megatron reduces amaxes over its data-parallel group
        ranks = torch_dist.get_world_size() if torch_dist.is_initialized() else 1
        self._group = torch_dist.group.WORLD if ranks > 1 else None

    def __call__(self) -> contextlib.AbstractContextManager:
        if hasattr(self._te, "autocast"):  # TE 2.8+: fp8_autocast is its deprecated alias
            return self._te.autocast(enabled=True, recipe=self._recipe, amax_reduction_group=self._group)
        return self._te.fp8_autocast(enabled=True, fp8_recipe=self._recipe, fp8_group=self._group)


def forward_context(
    device: torch.device, t: Any, model: torch.nn.Module | None = None
) -> Callable[..., contextlib.AbstractContextManager]:
    """The forward's precision context, fresh per call: half-precision autocast (fp32 weights), and TE's FP8 when
    `train.fp8` is set (the config rules have checked TE, CUDA, the GPU and TE layers by then).

    Called as `context(first=...)`: `first` says whether this forward is its global batch's first micro-batch.
    Under FP8 it reaches the built-in GPT's TE layers as is_first_microbatch (`model.first_microbatch`, for this
    forward only), as Megatron does: TE casts the weights to FP8 once per global batch, in the first forward,
    after the optimizer's step (a CPU-stepped layer's update lands before its forward), and reuses that cast in
    the others. Without it TE casts every weight again in every micro-batch and saves that cast for backward,
    which activation offload then copies to the host and back as if it were an activation."""
    half = autocast(device, t.precision, t.params_dtype)
    if t.fp8 is None:
        return lambda first=None: half
    fp8 = Fp8Forward(t)
    te_layers = model is not None and hasattr(model, "first_microbatch") and not getattr(model, "own_layers", True)
    cached = model if te_layers else None  # the built-in GPT with TE layers; megatron's TE spec keeps no cache

    @contextlib.contextmanager
    def both(first: bool | None = None) -> Iterator[None]:
        if cached is not None:
            cached.first_microbatch = first
        try:
            with half, fp8():
                yield
        finally:
            if cached is not None:
                cached.first_microbatch = None  # outside the engine's forward TE neither fills nor reads the cache

    return both
