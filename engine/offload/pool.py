"""Host buffer pool: byte buffers (pinned when CUDA is there) allocated once and leased again every iteration.

Buffers are keyed by their rounded size; the same shapes every iteration ask for the same sizes, so after the
first iteration no host memory is allocated. A buffer given back carries the event of the last copy that read
it (the reload), which the next copy into it waits for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_ALIGN = 512  # bytes; also keeps every dtype's element offset whole


def round_up(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def host_buffer_bytes(nbytes: int, pinned: bool) -> int:
    """Host bytes `HostPool.lease(nbytes)` allocates (the memory plan's activation pool is their sum): the
    512-byte rounding, and for a pinned buffer torch's pinned allocator's rounding up to a power of two."""
    size = round_up(nbytes)
    return 1 << (size - 1).bit_length() if pinned and size else size


@dataclass(eq=False)
class HostBuffer:
    data: torch.Tensor  # uint8 [capacity] on the host
    read_done: object = None  # cuda Event of the last copy that read this buffer, or None
    capacity: int = field(init=False)

    def __post_init__(self) -> None:
        self.capacity = self.data.numel()


class HostPool:
    """Free lists by rounded size. `allocated_bytes` only grows when a new size (or more of one) is asked for."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[HostBuffer]] = {}
        self.allocated_bytes = 0
        self.leased_bytes = 0

    def lease(self, nbytes: int) -> HostBuffer:
        size = round_up(nbytes)
        free = self._free.get(size)
        if free:
            buf = free.pop()
        else:
            buf = HostBuffer(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
            self.allocated_bytes += size
        self.leased_bytes += size
        return buf

    def give_back(self, buf: HostBuffer, read_done: object = None) -> None:
        buf.read_done = read_done
        self.leased_bytes -= buf.capacity
        self._free.setdefault(buf.capacity, []).append(buf)

    def clear(self) -> None:
        """Drop the free buffers (leased ones go when their holders give them back)."""
        self.allocated_bytes -= sum(b.capacity for bufs in self._free.values() for b in bufs)
        self._free.clear()
