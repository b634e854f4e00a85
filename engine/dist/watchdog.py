"""Failure propagation, so that no rank hangs when another fails.

A rank that fails posts its message to the rendezvous store (the one torchrun's agent or rank 0 hosts,
reached through a second client connection) and each rank runs a watchdog thread polling that store. A
rank blocked in a collective that will never finish (NCCL waits up to its timeout; gloo may report only
"connection closed") is ended by its watchdog, which prints the failing rank's message and exits non-zero,
so the job ends within a second or so. `start` also chains `sys.excepthook`, so a user's script that dies
uncaught still tells the other ranks.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

_POLL_S = 0.2  # watchdog period: how long a surviving rank may keep waiting after another failed
_LINGER_S = 5.0  # how long a failing rank waits for the others to read its message (it may host the store)
_state: dict[str, Any] = {"store": None, "failed": False, "watchdog": None}
_stop = threading.Event()


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


def start() -> None:
    """Starts this rank's watchdog (once) where the rendezvous store is reachable."""
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
    atexit.register(stop)  # a store client torn down under a running thread aborts the interpreter
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        previous(kind, exc, tb)  # the traceback first, as without us
        report_failure(f"{kind.__name__}: {exc}".splitlines()[0])

    sys.excepthook = hook  # a user's script that dies uncaught still tells the other ranks


def _wait_for(done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


def stop() -> None:
    t = _state["watchdog"]
    if t is not None:
        _stop.set()
        t.join()
        _state["watchdog"] = None
    _state["store"] = None


def report_failure(message: str) -> str:
    """Tells the other ranks this one failed with `message`, waits briefly for them to read it, and returns the
    message this rank should print: its own, or the earlier failure of another rank that caused it."""
    if _state["failed"] or _state["store"] is None or not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return message
    _state["failed"] = True  # stops this rank's watchdog: it reports its own failure
    store, n, me = _state["store"], tdist.get_world_size(), tdist.get_rank()
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
