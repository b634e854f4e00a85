"""The invariant messages a mechanism and the config layer both state: each text written once, here.

A mechanism (engine.models, engine.offload, engine.optim, engine.megatron) checks its own arguments for callers
without a config and raises with these words; the config layer (engine.config.rules) runs the same check on a
config and names the key. This module imports nothing from engine, so both sides may import it.
"""

from __future__ import annotations

TE_NEEDS_CUDA = 'Transformer Engine layers run on CUDA only; set train.device="auto" or "cuda", or model.use_te=false'


# stored unscaled, (1 - beta2) * grad^2 of clipped gradients (~5e-11) flushes to 0 below fp16's smallest subnormal
# (6e-8) and the update m / (sqrt(v) + eps) grows by |grad| / eps (a 1.2 B run diverged); (1 - beta1) * grad lies
# near or below fp16's smallest normal (6.1e-5), so small first moments keep few bits or flush to 0 (a 1.2 B run
# ended 5.4% higher in loss than fp32 states over 1000 steps, bf16 within 0.05%); megatron's TE FusedAdam scales
# its fp16 states, which is not built here
_FP16_LOSS = {
    "exp_avg": "small first moments lose their precision (a 1000-step run ended 5.4% higher in loss than fp32 states)",
    "exp_avg_sq": "the second moments of small gradients underflow to 0, which makes the update explode",
}


def unscaled_fp16_moments(state: str, bf16: str) -> str:
    """Why fp16 `state` ('exp_avg' or 'exp_avg_sq') is refused, with `bf16` as the caller spells the fix ('bf16' or
    torch.bfloat16)."""
    return f"fp16 moments are stored unscaled here: {_FP16_LOSS[state]}; use {bf16} (the same 2 bytes, fp32's range)"


def heads_divide_hidden(hidden_size: int, num_attention_heads: int) -> str | None:
    """What is wrong with model.hidden_size (its value is shown before the text) when the heads do not divide it."""
    if hidden_size % num_attention_heads:
        return (f"must be divisible by model.num_attention_heads ({num_attention_heads}); "
                "change model.hidden_size or model.num_attention_heads")  # fmt: skip
    return None


def offloaded_layer_count(num_layers: int, layers: int, counted: str = "") -> str | None:
    """What is wrong with model.cpu_offloading_num_layers=num_layers for a model of `layers` transformer layers
    (Megatron's words); `counted` says how the layers were found in a model of the user's."""
    if 0 <= num_layers < layers:
        return None
    return (f"CPU offloading can be done only for layers less than {layers}{f' ({counted})' if counted else ''}; "
            f"set model.cpu_offloading_num_layers between 0 and {layers - 1}")  # fmt: skip


def assist_needs_engine_adamw(optimizer: str, use_torch_optimizer: bool) -> str | None:
    """What is wrong with optimizer.cpu_offload_gpu_assist=true for this CPU-side optimizer, if anything."""
    if optimizer != "adam" or use_torch_optimizer:
        return ("works with the engine's own AdamW only (optimizer.optimizer='adam', "
                "use_torch_optimizer_for_cpu_offload=false); set optimizer.cpu_offload_gpu_assist=false")  # fmt: skip
    return None


def recomputed_layer_count(recomputed: int, offloaded: int | None, layers: int) -> str:
    """model.recompute_num_layers=recomputed for a model of `layers` layers, `offloaded` of them offloaded (None:
    activation offloading off): the recomputed block follows the offloaded layers, and a layer that is both is
    what Megatron forbids (in its words)."""
    if offloaded is None:
        return f"the model has {layers} layers; set model.recompute_num_layers between 0 and {layers}"
    return (f"CPU offloading does not work when activation recomputation is enabled on the same layer: "
            f"{offloaded} of {layers} layers are offloaded and {recomputed} would recompute after them; set "
            f"model.recompute_num_layers between 0 and {layers - offloaded}")  # fmt: skip
