"""Stopping on a signal: SIGTERM (what schedulers send before preemption) and SIGINT (Ctrl-C) let the step in
progress finish, so the loop can save a checkpoint and exit with the conventional code (128 + the signal's
number: 143, 130); a second signal exits at once, without saving. Before the loop (building, planning, loading:
`GracefulStop.aborting`) the first signal stops the run at once, since there is nothing to save yet.

The second signal cannot wait for Python: a signal handler written in Python runs only between bytecodes of the
main thread, never inside a long torch operation. So the C-level handler's wake-up byte (`signal.set_wakeup_fd`)
is read by a watcher thread, which counts the signals and ends the process on the second one wherever the main
thread is.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
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
    for the loop to act on between steps (inside `aborting()`: raises Stopped at once); a second one ends the
    process at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._aborting = False
        self._wakeup: tuple[int, int] | None = None  # (read end, the fd set_wakeup_fd held before)

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
            return self
        self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        read, write = os.pipe()
        os.set_blocking(write, False)  # set_wakeup_fd requires it
        self._wakeup = (read, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
        threading.Thread(target=self._watch, args=(read,), name="signal-watcher", daemon=True).start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
        if self._wakeup is not None:
            os.close(signal.set_wakeup_fd(self._wakeup[1]))  # our write end: the watcher reads EOF and ends
            self._wakeup = None

    @contextlib.contextmanager
    def aborting(self) -> Iterator[None]:
        """Within this block the first signal raises Stopped at once (nothing to finish or save yet)."""
        self._aborting = True
        try:
            if self.signum is not None:  # arrived before the block
                raise self._stopped_early(self.signum)
            yield
        finally:
            self._aborting = False

    @staticmethod
    def _stopped_early(signum: int) -> Stopped:
        return Stopped(128 + signum, f"stopped by {name(signum)} before the first iteration: nothing saved")

    def _watch(self, read: int) -> None:
        """The watcher thread: counts SIGTERM/SIGINT as their wake-up bytes arrive; exits the process on the second."""
        count = 0
        while data := os.read(read, 64):
            for signum in data:
                if signum not in SIGNALS:
                    continue
                count += 1
                self.signum = self.signum or signum
                if count >= 2:
                    os.write(2, f"\n{name(signum)} again: exiting now, without saving\n".encode())
                    os._exit(128 + signum)
        os.close(read)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler (the watcher counts): remembers the signal, or raises inside `aborting()`."""
        self.signum = self.signum or signum
        if self._aborting:
            self._aborting = False  # raised once; the unwinding code runs undisturbed
            raise self._stopped_early(signum)

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
