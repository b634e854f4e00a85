"""The CPU part's copies between the GPU and host memory, each on its own stream, ordered by events.

  gradients down   to_host(): on the D2H stream after the compute stream's work so far; the host waits for
                   a gradient's event (wait_d2h) before the CPU step reads it.
  weights up       upload(): on the H2D stream after the last backward (which may still read the weights
                   being replaced); the next forward's pre-hook makes the compute stream wait for the unit's
                   event (wait_unit), and the host must not rewrite the source before that event.
  weights down     weights_to_host(): the remainder form's bf16 weights (the masters' high halves) into a
                   weight-ring slot, on the D2H stream after the upload that last read the slot.
Without CUDA both are plain host copies and there are no events.
"""

from __future__ import annotations

import torch


class Transfers:
    def __init__(self, cuda: bool, units: list[str]) -> None:
        self.cuda = cuda
        self.d2h_stream = torch.cuda.Stream() if cuda else None
        self.h2d_stream = torch.cuda.Stream() if cuda else None
        self.d2h_event: dict[str, torch.cuda.Event | None] = {}  # by parameter name
        self.h2d_event: dict[str, torch.cuda.Event | None] = dict.fromkeys(units)  # by unit, until waited on

    def to_host(self, name: str, grad: torch.Tensor, buf: torch.Tensor) -> None:
        """Copy grad (any shape) into the 1-D host buffer buf."""
        if not self.cuda:
            buf.copy_(grad.reshape(-1))
            return
        self.d2h_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.d2h_stream):
            buf.copy_(grad.reshape(-1), non_blocking=True)
            self.d2h_event[name] = self.d2h_stream.record_event()
        grad.record_stream(self.d2h_stream)  # its memory returns to the pool only after the copy

    def wait_d2h(self, names: list[str]) -> None:
        for n in names:
            ev = self.d2h_event.get(n)
            if ev is not None:
                ev.synchronize()

    def weights_to_host(self, params: list[torch.nn.Parameter], bufs: list[torch.Tensor],
                        after: torch.cuda.Event | None, *, buffer_free: torch.cuda.Event | None = None,
                        wait: bool = True) -> torch.cuda.Event | None:  # fmt: skip
        """Copy each parameter into the 1-D host buffer beside it: the remainder form's weights, read after
        `after` (the last backward, which comes after the forward that waited for their upload), or None: after
        what the D2H stream already follows (a unit's gradients shipped, so its forward). buffer_free: the event
        of the upload still reading bufs, which the copy follows on the GPU (no host wait). With wait, returns once
        the copy is done; else returns its event, which the host synchronizes before it reads bufs."""
        if not self.cuda:
            for p, b in zip(params, bufs, strict=True):
                b.copy_(p.detach().reshape(-1))
            return None
        with torch.cuda.stream(self.d2h_stream):
            for ev in (after, buffer_free):
                if ev is not None:
                    self.d2h_stream.wait_event(ev)
            for p, b in zip(params, bufs, strict=True):
                b.copy_(p.detach().reshape(-1), non_blocking=True)
            done = self.d2h_stream.record_event()
        if wait:
            done.synchronize()
            return None
        return done

    def backward_done(self) -> torch.cuda.Event | None:
        return torch.cuda.current_stream().record_event() if self.cuda else None

    def upload(self, unit: str, params: list[torch.nn.Parameter], src: list[torch.Tensor],
               after: torch.cuda.Event | None) -> torch.cuda.Event | None:  # fmt: skip
        """Copy each 1-D host tensor in src into the parameter beside it; returns the copy's event (None
        without CUDA), which the unit's next forward waits on and before which src must not change."""
        if not self.cuda:
            with torch.no_grad():
                for p, s in zip(params, src, strict=True):
                    p.data.copy_(s.view(p.shape))
            return None
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(after)  # the last backward may still read these weights
            for p, s in zip(params, src, strict=True):
                p.data.copy_(s.view(p.shape), non_blocking=True)
            ev = self.h2d_stream.record_event()
        self.h2d_event[unit] = ev
        return ev

    def set_unit_event(self, unit: str, ev: torch.cuda.Event | None) -> None:
        self.h2d_event[unit] = ev

    def wait_unit(self, unit: str) -> None:
        """Make the compute stream wait for the unit's last upload (a GPU-side wait, not a host one)."""
        ev = self.h2d_event[unit]
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)
            self.h2d_event[unit] = None
