"""What a resumed run needs from the Engine, as one state dict (`engine_state`), and putting it back (`restore`).

The files themselves (atomic, verified, Megatron's layout) are engine.checkpoint's; this module decides what goes
in them: the iteration, the optimizer's and the model's state, the LR schedule, the loss scaler, the RNG states
and the data position, so a resumed run continues with the same losses. `eng` is an engine.Engine (not imported:
the Engine calls down to this module).
"""

from __future__ import annotations

from typing import Any

import torch

from engine import checkpoint, dist


def engine_state(eng: Any, client_state: dict | None) -> dict:
    """Everything a resumed run needs to continue with the same losses (after eng.synchronize())."""
    return {
        "iteration": eng.iteration,
        "optimizer": eng.optimizer.state_dict(),
        "model": eng.module.state_dict(),
        "lr_scheduler": eng.lr_scheduler.state_dict(),
        "loss_scaler": eng.scaler.state_dict(),
        "rng": {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        },
        "data": dist.data_state(None if eng.data_iter is None else eng.data_iter.state_dict()),
        "client_state": client_state or {},
    }


def restore(eng: Any, state: dict, load_dir: str) -> dict:
    """Puts `state` (a verified checkpoint of `load_dir`) back into `eng`; returns its client_state. A model
    planned at its first micro-batch gets its optimizer's and schedule's state there (held until they are built)."""
    if (why := checkpoint.state_mismatch(eng.module.state_dict(), state["model"])) is not None:
        raise checkpoint.CheckpointError(
            f"checkpoint.load={str(load_dir)!r} (iteration {state['iteration']}) does not fit this model: "
            f"{why}; load it with the model.* settings it was saved with"
        )
    eng.module.load_state_dict(state["model"])
    if eng._optimizer is None:
        eng._pending.restore.append(lambda: optimizer_state(eng, state, load_dir))
    else:
        optimizer_state(eng, state, load_dir)
    eng.scaler.load_state_dict(state["loss_scaler"])
    torch.set_rng_state(state["rng"]["cpu"])
    if torch.cuda.is_available() and state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    if state["data"] is not None:
        if eng.data_iter is None:
            eng.data_iter = eng.default_data()
        eng.data_iter.load_state_dict(dist.rescale_data_state(state["data"], eng.data_parallel_size))
    eng.iteration = int(state["iteration"])
    eng.micro_step = 0
    return state["client_state"]


def optimizer_state(eng: Any, state: dict, load_dir: str) -> None:
    """The optimizer's and the LR schedule's state; CheckpointError (one line) where optimizer.* differs."""
    try:
        eng.optimizer.load_state_dict(state["optimizer"])
    except (KeyError, ValueError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise checkpoint.CheckpointError(
            f"checkpoint.load={str(load_dir)!r} (iteration {state['iteration']}): its optimizer state does "
            f"not fit optimizer.* of this run ({type(e).__name__}: {first}); resume with the optimizer "
            "settings it was saved with"
        ) from e
    eng.lr_scheduler.load_state_dict(state["lr_scheduler"])
