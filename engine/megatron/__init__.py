"""megatron-core and Transformer Engine integration (the optional `megatron` and `te` extras).

    from engine import megatron
    megatron.available()                           # is megatron-core importable?
    model = megatron.build_gpt(cfg.model)          # MegatronGPT: tokens [b, s] -> logits [b, s, v]
    model = megatron.as_engine_module(user_model)  # a user's GPTModel behind the same adapter
    opt = megatron.build_hybrid_optimizer(model, cfg.optimizer)   # megatron-core's HybridDeviceOptimizer (CUDA)

Module map: parallel (torch.distributed + parallel_state set-up), attention (a CPU-capable core attention for
the local spec), gpt (GPTModel from `model.*` and its adapter), optimizer (HybridDeviceOptimizer built as
Megatron builds it, with the engine's step protocol). Whether the extras import, and their install hints, is
engine/extras.py; Transformer Engine blocks for the built-in GPT are engine/models/te.py. Nothing here
imports megatron-core until it is used.
"""

from engine.extras import (
    MissingExtraError,
    available,
    require,
    require_te,
    te_available,
    version,
)
from engine.megatron.gpt import (
    MegatronGPT,
    as_engine_module,
    build_gpt,
    is_gpt_model,
    meta_gpt,
    transformer_config,
)
from engine.megatron.optimizer import (
    MegatronOptimizerAdapter,
    build_hybrid_optimizer,
    build_megatron_optimizer,
    megatron_param_groups,
)
from engine.megatron.parallel import ensure_model_parallel, teardown

__all__ = [
    "MegatronGPT",
    "MegatronOptimizerAdapter",
    "MissingExtraError",
    "as_engine_module",
    "available",
    "build_gpt",
    "build_hybrid_optimizer",
    "build_megatron_optimizer",
    "ensure_model_parallel",
    "is_gpt_model",
    "megatron_param_groups",
    "meta_gpt",
    "require",
    "require_te",
    "te_available",
    "teardown",
    "transformer_config",
    "version",
]
