"""Data parallelism on torch.distributed, one job per module; the engine uses them through this package
(`from engine import dist; dist.rank()`).

  group.py       the process group: joined from torchrun's environment, who this process is, rank-aware
                 logging, shutdown (engine.initialize then runs the config rules that read the real world size)
  watchdog.py    failure propagation: a failing rank posts its message, the others' watchdogs end the job
  ddp.py         what the engine composes: DDP over the model, gradient-sync control, averages, rank-0 work
  data_state.py  the data iterator's position in a checkpoint, across data-parallel sizes

One process is the degenerate case: every helper is then a no-op returning the single-process answer.
"""

from engine.dist.data_state import data_state, rescale_data_state
from engine.dist.ddp import average, on_main, set_grad_sync, wrap_model
from engine.dist.group import (
    backend_for,
    is_distributed,
    is_main,
    local_rank,
    log,
    rank,
    rank_path,
    setup,
    shutdown,
    world_size,
)
from engine.dist.watchdog import report_failure

__all__ = [
    "average",
    "backend_for",
    "data_state",
    "is_distributed",
    "is_main",
    "local_rank",
    "log",
    "on_main",
    "rank",
    "rank_path",
    "report_failure",
    "rescale_data_state",
    "set_grad_sync",
    "setup",
    "shutdown",
    "world_size",
    "wrap_model",
]
