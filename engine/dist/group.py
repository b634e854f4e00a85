"""The process group: joined from the torchrun environment, who this process is, rank-aware logging, shutdown.

One process is the degenerate case: with no WORLD_SIZE (or WORLD_SIZE=1) and no process group, `setup` does
nothing and every helper here returns the single-process answer.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from engine.dist import watchdog

_owned_group = False  # whether `setup` created the process group (and `shutdown` should destroy it)


def is_distributed() -> bool:
    """True when a process group of more than one rank is up."""
    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


def world_size() -> int:
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank (from the environment before `setup`, so early errors print once)."""
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank()
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def log(*args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only."""
    if is_main():
        print(*args, **kwargs)


def rank_path(path: str | None) -> str | None:
    """Each rank's own copy of a per-run file: rank 0 keeps `path`, rank r writes `<stem>.rank<r><suffix>`."""
    if path is None or rank() == 0:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank()}{p.suffix}"))


def backend_for(device_choice: str) -> str:
    """NCCL when the ranks train on GPUs, gloo on CPUs."""
    on_gpu = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    return "nccl" if on_gpu else "gloo"


def setup(device_choice: str = "auto", timeout_s: float | None = None) -> int:
    """Joins the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and starts the
    failure watchdog; returns the world size. A no-op for a single process or an existing process group (a
    user's script may have set one up itself). On GPUs each rank uses cuda:LOCAL_RANK."""
    n = int(os.environ.get("WORLD_SIZE", "1"))
    if not tdist.is_available() or (n <= 1 and not tdist.is_initialized()):
        return 1
    if not tdist.is_initialized():
        backend = backend_for(device_choice)
        if backend == "nccl":
            torch.cuda.set_device(local_rank())  # before the group exists, so NCCL binds this rank's GPU
        kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", local_rank())
        tdist.init_process_group(backend=backend, **kwargs)
        global _owned_group
        _owned_group = True
    watchdog.start()
    return tdist.get_world_size()


def shutdown() -> None:
    """Stops the watchdog and leaves the process group this module created (after a barrier, so no rank tears
    down under another; the watchdog still guards that barrier)."""
    global _owned_group
    if _owned_group and tdist.is_initialized():
        tdist.barrier()
    watchdog.stop()
    if _owned_group and tdist.is_initialized():
        tdist.destroy_process_group()
        _owned_group = False
