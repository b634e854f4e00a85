"""Stopping on a signal: SIGTERM (what schedulers send before preemption) and SIGINT (Ctrl-C) let the step in
progress finish, so the loop can save a checkpoint and exit with the conventional code (128 + the signal's
number: 143, 130); a second signal exits at once, without saving.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType

import torch

from engine import dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """The run stopped on a signal after saving what it could; `code` is the process's exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class GracefulStop:
    """While active (a `with` block in the main thread), the first SIGTERM or SIGINT is remembered in `signum`
    for the loop to act on between steps; a second one ends the process at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            os.write(2, f"\n{signal.Signals(signum).name} again: exiting now, without saving\n".encode())
            os._exit(128 + signum)
        self.signum = signum

    def requested(self, device: torch.device) -> int | None:
        """The signal this rank, or any rank, received; every rank gets the same answer, so all stop together."""
        if not dist.is_distributed():
            return self.signum
        import torch.distributed as tdist

        flag = torch.tensor([self.signum or 0], device=device)
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
        return int(flag.item()) or None


def name(signum: int) -> str:
    return signal.Signals(signum).name
