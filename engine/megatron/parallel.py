"""megatron-core's global state for one model-parallel rank: torch.distributed, parallel_state (TP=PP=1) and,
on CUDA, its model-parallel RNG tracker. Each piece is set up only where the user has not already done so.

megatron-core reads its process groups from `parallel_state` everywhere (layers ask for the TP group even at
TP=1), so a GPTModel cannot be built before this has run.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from engine.extras import require

log = logging.getLogger(__name__)

# what this module created, so teardown() undoes only that
_created = {"process_group": False, "model_parallel": False}


def ensure_model_parallel(seed: int = 1234, device: torch.device | str | None = None) -> None:
    """Initialise what megatron-core needs, keeping whatever the caller already initialised.

    - torch.distributed: if not initialised, a single-process group (rank 0 of 1) on an in-process
      HashStore, so no port is taken; nccl when `device` is CUDA, gloo otherwise. A multi-process launch
      (torchrun) must initialise the group itself first (the engine's dist setup does).
    - parallel_state: `initialize_model_parallel(1, 1)` if not initialised; data parallel is the world.
    - CUDA only, if nobody has: `model_parallel_cuda_manual_seed(seed)`, the RNG tracker megatron's
      dropout and GPU weight init fork from. It needs CUDA, so on CPU it is skipped; models built here
      use CPU initialisation anyway (`use_cpu_initialization`), which needs no tracker.
    """
    require("model.implementation='megatron'")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _created["process_group"] = True
        log.info("megatron: initialised torch.distributed (%s, 1 process) for megatron-core", backend)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        _created["model_parallel"] = True
        log.info("megatron: initialised megatron-core parallel_state (TP=1, PP=1, DP=%d)", dist.get_world_size())
    elif parallel_state.get_tensor_model_parallel_world_size() != 1 or (
        parallel_state.get_pipeline_model_parallel_world_size() != 1
    ):
        raise ValueError("the engine runs megatron-core models at TP=PP=1; the caller initialised other sizes")
    if cuda and torch.cuda.is_available() and not mp_random.get_cuda_rng_tracker().is_initialized():
        # a user who seeded megatron's tracker keeps their streams; otherwise ours, from train.seed
        mp_random.model_parallel_cuda_manual_seed(seed)


def teardown() -> None:
    """Destroy what `ensure_model_parallel` created (tests, or a process that builds twice)."""
    if _created["model_parallel"]:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        _created["model_parallel"] = False
    if _created["process_group"] and dist.is_initialized():
        dist.destroy_process_group()
        _created["process_group"] = False
