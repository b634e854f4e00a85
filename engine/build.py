"""Builders from config: the model `model.*` describes and the optimizer `optimizer.*` describes.

The model is built on the meta device and materialised on its target device in its final dtype, then
initialised there (engine.models.init): the host never holds a copy of a model trained on the GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import Config, ModelConfig
from engine.models.gpt import GPT, ffn_size, recomputed_layers
from engine.models.init import has_meta, materialize


def gpt_shape(m: ModelConfig, num_layers: int | None = None) -> dict[str, int]:
    """The built-in GPT's shape from `model.*` (num_layers: another depth), as GPT's keyword arguments: the one
    place both the builder and the memory plan read it."""
    return {"num_layers": m.num_layers if num_layers is None else num_layers, "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads, "seq_length": m.seq_length, "vocab_size": m.vocab_size,
            "ffn_hidden_size": ffn_size(m.hidden_size, m.ffn_hidden_size)}  # fmt: skip


def offloaded_layers(m: ModelConfig) -> int:
    """How many layers activation offloading takes (resolved: "auto" has been chosen by now)."""
    return int(m.cpu_offloading_num_layers) if m.cpu_offloading else 0


def build_model(m: ModelConfig, device: torch.device, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The GPT `model.implementation` names, shaped by `model.*`, on `device` in `dtype`, initialised from `seed`."""
    if m.implementation == "megatron":
        from engine import megatron

        return megatron.build_gpt(m, device=device, seed=seed, dtype=dtype)
    layers = None
    if m.use_te:
        from engine.models.te import build_te_layers

        # TE allocates and initialises its blocks on the GPU itself, in their final dtype
        layers = build_te_layers(num_layers=m.num_layers, hidden_size=m.hidden_size,
                                 num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_hidden_size,
                                 init_method_std=m.init_method_std, device=device, params_dtype=dtype)  # fmt: skip
    with torch.device("meta"):
        model = GPT(
            **gpt_shape(m),
            init_method_std=m.init_method_std,
            recompute_granularity=m.recompute_granularity,
            layers=layers,
            recompute_layers=recomputed_layers(m.num_layers, offloaded_layers(m), m.recompute_num_layers),
        )
    return materialize(model, device, dtype, seed)


def place_model(model: nn.Module, device: torch.device, dtype: torch.dtype | None, seed: int) -> nn.Module:
    """A user's model on `device`, floating tensors in `dtype` (None: as they are). A model on the meta device is
    materialised there (engine.models.init); one already on `device` in `dtype` is used as it is, not copied."""
    if has_meta(model):
        materialize(model, device, dtype, seed)
    return model.to(device=device, dtype=dtype)


def build_optimizer(groups: list[dict], cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer `optimizer.*` describes over named parameter groups (model already on its device)."""
    o = cfg.optimizer
    if o.implementation == "megatron":
        from engine import megatron

        return megatron.build_hybrid_optimizer(model, o, param_groups=groups)
    from engine.optim import HybridDeviceOptimizer, HybridOptions
    from engine.optim.options import STATE_DTYPE

    # one optimizer for every case: at fraction 0 it is the plain device optimizer (with fp32 masters
    # for half weights); the config refuses an offload option set without its master switch
    return HybridDeviceOptimizer(
        groups,
        HybridOptions(
            optimizer=o.optimizer,
            lr=o.lr,
            betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps,
            momentum=o.sgd_momentum,
            offload_fraction=o.optimizer_offload_fraction,
            overlap_cpu_optimizer_d2h_h2d=o.overlap_cpu_optimizer_d2h_h2d,
            pin_cpu_grads=o.pin_cpu_grads,
            pin_cpu_params=o.pin_cpu_params,
            use_torch_optimizer_for_cpu_offload=o.use_torch_optimizer_for_cpu_offload,
            cpu_threads=o.cpu_optimizer_threads,
            pin_cpu_threads=o.cpu_optimizer_pin_threads,
            accumulate_grads_in_fp32=o.accumulate_allreduce_grads_in_fp32,
            gpu_assist=o.cpu_offload_gpu_assist,
            delayed_param_update=o.delayed_param_update,
            delayed_param_update_warmup=o.delayed_param_update_warmup,
            speculation_buffer_mb=o.speculation_buffer_mb,
            exp_avg_dtype=STATE_DTYPE[o.exp_avg_dtype],
            exp_avg_sq_dtype=STATE_DTYPE[o.exp_avg_sq_dtype],
            store_param_remainders=o.store_param_remainders,  # both parts: acts at fraction 0 too
        ),
    )
