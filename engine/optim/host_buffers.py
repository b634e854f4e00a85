"""Host memory for the CPU-stepped parameters: flat buffers allocated once, handed out as views.

One flat buffer per role and dtype keeps the pinned allocations few and exact in size: torch's
pinned allocator rounds every request up to a power of two, so pinned buffers are taken as plain
host memory and registered with the driver (cudaHostRegister) instead, which pins exactly the bytes.
Without CUDA (or with pinning off) they stay ordinary pageable memory.
"""

from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger(__name__)


def _register(t: torch.Tensor) -> bool:
    """Pin t's memory in place; unpins when t is freed. False where the driver refuses."""
    cudart = torch.cuda.cudart()
    ptr, size = t.data_ptr(), t.numel() * t.element_size()
    err = cudart.cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        log.warning("cudaHostRegister of %d bytes failed (%s); falling back to torch's pinned allocator", size, err)
        return False
    weakref.finalize(t.untyped_storage(), cudart.cudaHostUnregister, ptr)
    return True


def flat_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A 1-D host tensor of numel elements, pinned when asked and CUDA is present."""
    t = torch.empty(numel, dtype=dtype)
    if pin and numel and torch.cuda.is_available() and not _register(t):
        t = t.pin_memory()
    return t


class FlatViews:
    """Per-name views [offset, offset + numel) into one flat buffer, in the order names were laid out."""

    def __init__(self, layout: dict[str, tuple[int, torch.Size]], dtype: torch.dtype, pin: bool) -> None:
        total = sum(s.numel() for _, s in layout.values())
        self.flat = flat_buffer(total, dtype, pin)
        self.views = {n: self.flat[o : o + s.numel()] for n, (o, s) in layout.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.views[name]

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()
