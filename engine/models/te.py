"""Transformer Engine blocks for the built-in GPT (`model.use_te=true`), gated on the `te` extra.

`build_te_layers` returns a ModuleList of `transformer_engine.pytorch.TransformerLayer` in the built-in GPT's
shape and layout: pre-norm LayerNorm, causal self-attention, GELU MLP, no dropout, input and output
[batch, seq, hidden] (`attn_input_format="bshd"`), so it can stand in for `GPT.layers` one for one. TE builds
its weights on CUDA in `params_dtype` (the run's final dtype: nothing on the host, no cast afterwards) and
initialises them itself there (normal(0, std) drawn in that dtype from torch's CUDA generator, the output
projections scaled by depth as Megatron does); the built-in GPT's name-based init must not run over them.

Activation offloading needs nothing special for TE layers in bf16/fp16: TE's autograd functions save plain
tensors with `ctx.save_for_backward` (FP8 tensors are split into plain data and scale tensors before saving),
which the engine's saved-tensor hooks see like any other. TE is not installable on the CI machine, so only
the missing-extra error is tested there.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.extras import require_te
from engine.messages import TE_NEEDS_CUDA


def _normal_init(std: float):
    def init(w: torch.Tensor) -> None:
        nn.init.normal_(w, 0.0, std)

    return init


def build_te_layers(
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    ffn_hidden_size: int | None = None,
    init_method_std: float = 0.02,
    device: torch.device | str = "cuda",
    params_dtype: torch.dtype = torch.float32,
) -> nn.ModuleList:
    """`num_layers` TE TransformerLayers: x [b, s, h] -> [b, s, h], causal. Needs CUDA and the `te` extra."""
    require_te("model.use_te=true")
    if torch.device(device).type != "cuda":
        raise RuntimeError(f"model.use_te=true: {TE_NEEDS_CUDA}")
    import transformer_engine.pytorch as te

    return nn.ModuleList(
        te.TransformerLayer(
            hidden_size,
            ffn_hidden_size or 4 * hidden_size,
            num_attention_heads,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            init_method=_normal_init(init_method_std),
            output_layer_init_method=_normal_init(init_method_std / (2 * num_layers) ** 0.5),
            layer_number=i + 1,
            self_attn_mask_type="causal",
            attn_input_format="bshd",
            params_dtype=params_dtype,
            device=device,
        )
        for i in range(num_layers)
    )
