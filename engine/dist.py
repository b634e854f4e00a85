"""Data parallelism on torch.distributed: process-group setup from the torchrun environment, rank-aware
logging, gradient reduction through torch DDP, and failure propagation so that no rank hangs.

One process is the degenerate case: with no WORLD_SIZE (or WORLD_SIZE=1) and no process group,
`setup` does nothing and every helper here is a no-op returning the single-process answer.

Failure propagation: a rank that fails posts its message to the rendezvous store (the one
torchrun's agent or rank 0 hosts, reached through a second client connection) and each rank runs a
watchdog thread polling that store. A rank blocked in a collective that will never finish (NCCL
waits up to its timeout; gloo may report only "connection closed") is ended by its watchdog, which
prints the failing rank's message and exits non-zero, so the job ends within a second or so.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as tdist
from torch import nn

from engine.config import Config, check_world_size

T = TypeVar("T")

_POLL_S = 0.2  # watchdog period: how long a surviving rank may keep waiting after another failed
_LINGER_S = 5.0  # how long a failing rank waits for the others to read its message (it may host the store)
_state: dict[str, Any] = {"store": None, "failed": False, "owned_group": False, "watchdog": None}
_stop = threading.Event()


# --- who am I ----------------------------------------------------------------------------------------------
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


# --- setup and shutdown ------------------------------------------------------------------------------------
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
        _state["owned_group"] = True
    _start_watchdog()
    return tdist.get_world_size()


def setup_for(cfg: Config) -> int:
    """`setup` for a validated config's device, then its rules that read the data-parallel size checked at the
    actual world size (config.check_world_size: e.g. the batch arithmetic; raises ConfigError)."""
    n = setup(cfg.train.device)
    if n > 1:
        check_world_size(cfg, n)
    return n


def shutdown() -> None:
    """Stops the watchdog and leaves the process group this module created (after a barrier, so no rank tears
    down under another; the watchdog still guards that barrier)."""
    if _state["owned_group"] and tdist.is_initialized():
        tdist.barrier()
    _stop_watchdog()
    if _state["owned_group"] and tdist.is_initialized():
        tdist.destroy_process_group()
        _state["owned_group"] = False


# --- failure propagation -----------------------------------------------------------------------------------
def _key(name: str) -> str:
    # torchrun restarts reuse the agent's store: keep each attempt's keys apart
    return f"engine.dist/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


def _connect_store() -> Any:
    """A client of the rendezvous store of its own, so polling never shares a socket with the process group."""
    if _state["store"] is None:
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return None
        _state["store"] = tdist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30),
                                         wait_for_workers=False)  # fmt: skip
    return _state["store"]


def _first_failure(store: Any, n: int) -> tuple[int, str] | None:
    for r in range(n):
        if store.check([_key(f"error/{r}")]):
            return r, store.get(_key(f"error/{r}")).decode("utf-8", "replace")
    return None


def _watch(store: Any, n: int) -> None:
    while not _state["failed"] and not _stop.is_set():
        try:
            if store.add(_key("errors"), 0) > 0 and (hit := _first_failure(store, n)) and not _state["failed"]:
                print(f"error: rank {hit[0]} failed: {hit[1]}", file=sys.stderr, flush=True)
                store.add(_key("acks"), 1)
                _wait_for(lambda: store.check([_key("released")]), _LINGER_S)  # leave no one a dead store
                os._exit(1)  # the main thread may be blocked in a collective that will never finish
        except Exception:  # the store went away with its host: the launcher is ending the job anyway
            return
        _stop.wait(_POLL_S)


def _start_watchdog() -> None:
    try:
        store = _connect_store()
    except Exception:  # no reachable store (a user's own rendezvous): failures then rely on the launcher
        store = None
    if store is None or _state["watchdog"] is not None:
        return
    t = threading.Thread(target=_watch, args=(store, tdist.get_world_size()),
                         name="engine.dist watchdog", daemon=True)  # fmt: skip
    _stop.clear()
    t.start()
    _state["watchdog"] = t
    atexit.register(_stop_watchdog)  # a store client torn down under a running thread aborts the interpreter
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        previous(kind, exc, tb)  # the traceback first, as without us
        report_failure(f"{kind.__name__}: {exc}".splitlines()[0])

    sys.excepthook = hook  # a user's script that dies uncaught still tells the other ranks


def _wait_for(done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


def _stop_watchdog() -> None:
    t = _state["watchdog"]
    if t is not None:
        _stop.set()
        t.join()
        _state["watchdog"] = None
    _state["store"] = None


def report_failure(message: str) -> str:
    """Tells the other ranks this one failed with `message`, waits briefly for them to read it, and returns the
    message this rank should print: its own, or the earlier failure of another rank that caused it."""
    if _state["failed"] or not is_distributed() or _state["store"] is None:
        return message
    _state["failed"] = True  # stops this rank's watchdog: it reports its own failure
    store, n, me = _state["store"], world_size(), rank()
    try:
        earlier = _first_failure(store, n)
        store.set(_key(f"error/{me}"), message)
        store.add(_key("errors"), 1)
        # every rank that did not fail itself acknowledges once, from its watchdog
        _wait_for(lambda: store.add(_key("acks"), 0) >= n - store.add(_key("errors"), 0), _LINGER_S)
        store.set(_key("released"), "1")
        time.sleep(_POLL_S)  # the survivors see it and exit before this rank (maybe the store's host) does
    except Exception:
        return message
    if earlier is not None and earlier[0] != me:
        return f"rank {earlier[0]} failed: {earlier[1]}"
    return f"rank {me}: {message}"


# --- data parallel pieces the engine composes --------------------------------------------------------------
def wrap_model(module: nn.Module, device: torch.device, optimizer: Any = None) -> nn.Module:
    """The module the engine runs forward through: DDP over `module` when distributed (gradients all-reduced
    in buckets while backward runs, or reduced to their owners when `optimizer`, an EngineOptimizer, shards
    and gives a `comm_hook()`), else `module` itself. DDP broadcasts rank 0's weights at construction."""
    if not is_distributed():
        return module
    ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(module, device_ids=ids)
    hook = None if optimizer is None else optimizer.comm_hook()
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    return ddp


def set_grad_sync(module: nn.Module, sync: bool) -> None:
    """Before a micro-batch's forward: reduce gradients in its backward only if it is the last micro-batch.

    DDP's `no_sync()` context sets this flag; the engine's forward/backward/step loop API cannot hold a
    context across calls, so it sets the flag DDP reads at forward time directly."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        module.require_backward_grad_sync = sync


def average(value: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over ranks (e.g. the loss to log); `value` itself with one process."""
    if not is_distributed():
        return value
    out = value.detach().clone()
    tdist.all_reduce(out)  # a synchronisation the log's loss needs; once per global batch
    return out / world_size()


def on_main(fn: Callable[[], T]) -> T:
    """Runs `fn` on rank 0 only (e.g. writing a checkpoint) and returns its result on every rank, after it is done."""
    if not is_distributed():
        return fn()
    box = [fn() if is_main() else None]
    tdist.broadcast_object_list(box, src=0)  # also the barrier: no rank moves on before the write is complete
    return box[0]


def data_state(state: dict | None) -> dict | None:
    """The data iterator's state with the data-parallel size it was saved at."""
    return None if state is None else {**state, "data_parallel_size": world_size()}


def rescale_data_state(state: dict, new_world_size: int | None = None) -> dict:
    """A data state saved with N ranks, for M ranks: each rank has drawn index micro-batches, so the global count
    index * N is the same stream position, of which each of M ranks has drawn index * N / M."""
    m = new_world_size or world_size()
    n = int(state.get("data_parallel_size", 1))
    consumed = int(state["index"]) * n
    if consumed % m:
        raise ValueError(f"checkpoint: {consumed} micro-batches drawn over {n} ranks do not split evenly over {m} "
                         "ranks; keep train.micro_batch_size and choose a data-parallel size dividing "
                         "global_batch_size / micro_batch_size")  # fmt: skip
    return {k: v for k, v in state.items() if k != "data_parallel_size"} | {"index": consumed // m}
