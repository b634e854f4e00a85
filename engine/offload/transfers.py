"""Copies between device memory and host buffers: CUDA side streams with events, or plain host copies on CPU.

Both classes have one interface so the offload logic above them is the same code on a GPU and in CPU tests.
On CUDA: offload copies run on a D2H stream after the compute that wrote the tensor, reloads on an H2D stream;
the compute stream waits only on events, never the host.
"""

from __future__ import annotations

import torch

from engine.offload.pool import HostBuffer


class HostTransfers:
    """CPU path: copies happen at once, events are None, waits are no-ops."""

    pin_memory = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def copy_out(self, src: torch.Tensor, buf: HostBuffer) -> None:
        """src: uint8 [n] on the device, the whole storage of a saved tensor -> buf.data[:n]."""
        buf.data[: src.numel()].copy_(src)

    def record_out(self) -> object:
        return None

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_in(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: object) -> object:
        for dst, src in pairs:
            dst.copy_(src)
        return None

    def wait(self, event: object) -> None:
        pass


class CudaTransfers(HostTransfers):
    """GPU path: pinned host buffers, one D2H and one H2D stream, ordering through events only."""

    pin_memory = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def copy_out(self, src: torch.Tensor, buf: HostBuffer) -> None:
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))  # the copy reads what compute just wrote
        if buf.read_done is not None:  # the buffer's last reload has read it
            self.d2h.wait_event(buf.read_done)
        with torch.cuda.stream(self.d2h):
            buf.data[: src.numel()].copy_(src, non_blocking=True)
        # the tensor's memory goes back to the allocator when compute drops it, but is not handed out
        # again before this copy has read it; the compute stream never waits for the copy
        src.record_stream(self.d2h)

    def record_out(self) -> object:
        event = torch.cuda.Event()
        event.record(self.d2h)
        return event

    def copy_in(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: object) -> object:
        # destinations come from the compute stream's memory (or a double buffer it last read): start after it
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:  # the offload copy of these bytes has finished
            self.h2d.wait_event(after)
        with torch.cuda.stream(self.h2d):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        for dst, _ in pairs:
            dst.record_stream(self.h2d)
        event = torch.cuda.Event()
        event.record(self.h2d)
        return event

    def wait(self, event: object) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


def make_transfers(device: torch.device) -> HostTransfers:
    """Pick the path once: CUDA streams for a CUDA device, host copies otherwise."""
    return CudaTransfers(device) if device.type == "cuda" else HostTransfers(device)
