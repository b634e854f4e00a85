"""The offload session: which saved tensors go to the host, and when each group comes back.

Units are the modules that take part, in forward order (layers, or chosen sub-modules); some offload, the rest
only mark where backward is. One forward pass makes one *chain* of groups, one per offloading unit, so
interleaved micro-batches (pipeline schedules) keep separate chains and each reloads its own predecessors.

Schedule (CUDA; on CPU the same calls copy at once):
- forward: each saved storage is copied out as soon as it is saved; before offloading unit j runs, compute
  waits for the offload copies of unit j-2, so at most two units' tensors are in flight (this bounds memory,
  and costs nothing unless the copies are more than a unit behind, which is the PCIe floor anyway); units
  that do not offload never wait, so the last copies overlap them;
- backward: when the gradient of unit j's output arrives (its backward starts), unit j's group is reloaded if
  nothing prefetched it, then the groups of units j-1 .. j-lookahead are issued on the H2D stream, so they
  come back while unit j computes. `lookahead` is 1 with double buffering (two device buffers reused by every
  reload of one backward, freed once unit 0 is done), else chosen by the caller so reloaded groups never
  exceed what backward has already freed.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from engine.offload.groups import DONE, OFFLOADED, Group, is_weight_copy
from engine.offload.pool import HostPool, round_up
from engine.offload.transfers import HostTransfers, make_transfers


class Chain:
    """The groups of one forward pass, by unit index (weak: a group lives as long as autograd's slots)."""

    def __init__(self, n_units: int) -> None:
        self.groups: list[weakref.ref | None] = [None] * n_units
        self.last = -1

    def group(self, i: int) -> Group | None:
        ref = self.groups[i] if 0 <= i < len(self.groups) else None
        return ref() if ref is not None else None


def slab_bytes(stash_sizes: list[int]) -> int:
    """Device bytes one double-buffer slab needs to take a group of stashes of these sizes."""
    return sum(round_up(n) for n in stash_sizes)


def double_buffer_bytes(groups: list[list[int]]) -> int:
    """Device bytes of the two slabs once every group (its stash sizes) was reloaded: each grows to the largest
    group and is reused by every reload of one backward (the memory plan calls this)."""
    return 2 * max((slab_bytes(g) for g in groups if g), default=0)


class DoubleBuffer:
    """Two device slabs used alternately by successive reloads (fewer allocations, no fragmentation)."""

    def __init__(self, transfers: HostTransfers) -> None:
        self.transfers = transfers
        self.slabs: list[torch.Tensor | None] = [None, None]
        self.owners: list[weakref.ref | None] = [None, None]
        self.parity = 0
        self.served = 0  # reloads that went into a slab (for tests and metrics)

    def free(self) -> None:
        """Backward has passed the offloaded units: the slabs go back to the allocator until the next one."""
        self.slabs, self.owners = [None, None], [None, None]

    def take(self, group: Group) -> list[torch.Tensor] | None:
        p, self.parity = self.parity, self.parity ^ 1
        owner = self.owners[p]() if self.owners[p] is not None else None
        if owner is not None and owner.state != DONE:
            return None  # its last occupant is still in use (an unusual backward order): allocate instead
        sizes = [round_up(st.nbytes) for st in group.stashes]
        need = slab_bytes([st.nbytes for st in group.stashes])
        if self.slabs[p] is None or self.slabs[p].numel() < need:
            self.slabs[p] = None  # grows to the largest group, then is reused by every reload of this backward
            self.slabs[p] = self.transfers.alloc(need)
        self.owners[p] = weakref.ref(group)
        self.served += 1
        out, offset = [], 0
        for st, size in zip(group.stashes, sizes, strict=True):
            out.append(self.slabs[p][offset : offset + st.nbytes])
            offset += size
        return out


class OffloadSession:
    """State shared by the units of one `apply_*` call: device, pool, transfers, policy, current chain."""

    def __init__(
        self,
        model: nn.Module,
        n_units: int,
        *,
        activations: bool,
        weights: bool,
        double_buffering: bool,
        lookahead: int,
        min_bytes: int,
        device: torch.device | None = None,
    ) -> None:
        self.model = model
        self.n_units = n_units
        self.activations, self.weights = activations, weights
        self.min_bytes = min_bytes
        self.lookahead = lookahead
        if device is None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = device
        self.transfers = make_transfers(device)
        self.pool = HostPool(pin=self.transfers.pin_memory)
        self.double_buffer = DoubleBuffer(self.transfers) if double_buffering else None
        self.held_bytes = 0
        self.peak_held_bytes = 0  # the high point, reached at the end of forward (held_bytes is 0 after backward)
        # what was moved, per unit, for the report (offload.report): bytes copied out since the start, the most
        # one forward call of the unit copied, and saved tensors kept on the device only for being small
        self.moved_bytes = [0] * n_units
        self.peak_call_bytes = [0] * n_units
        self.kept_small = [0] * n_units
        self.calls = [0] * n_units
        self.chain: Chain | None = None
        self._param_ptrs: set[int] = set()
        self._param_ids: set[int] = set()

    # ---- what is offloaded ---------------------------------------------------------------------------
    def _refresh_params(self) -> None:
        # once per forward pass: a hybrid optimizer may give parameters new storage between steps
        tensors = [*self.model.parameters(), *self.model.buffers()]
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in tensors} - {0}
        self._param_ids = {id(p) for p in tensors}

    def record(self, unit: int, moved: int, kept_small: int) -> None:
        """One forward call of `unit` copied `moved` bytes out and kept `kept_small` small tensors."""
        self.moved_bytes[unit] += moved
        self.peak_call_bytes[unit] = max(self.peak_call_bytes[unit], moved)
        self.kept_small[unit] += kept_small
        self.calls[unit] += 1

    def is_small(self, t: torch.Tensor) -> bool:
        """A saved activation kept on the device only because its storage is at most `min_bytes`."""
        if t.device != self.device or t.layout != torch.strided:
            return False
        storage = t.untyped_storage()
        return storage.nbytes() <= self.min_bytes and storage.data_ptr() not in self._param_ptrs

    def should_offload(self, t: torch.Tensor) -> bool:
        if t.device != self.device or t.layout != torch.strided:
            return False
        storage = t.untyped_storage()
        if storage.nbytes() <= self.min_bytes or storage.data_ptr() in self._param_ptrs:
            return False  # tiny, or a parameter (or a view of one): a copy would free nothing
        if is_weight_copy(t, self._param_ids):
            return self.weights
        return self.activations

    # ---- forward -------------------------------------------------------------------------------------
    def begin(self, unit: int, offloads: bool) -> Group | None:
        chain = self.chain
        if chain is None or unit <= chain.last:  # unit 0 (or a repeat) starts a new forward pass
            chain = self.chain = Chain(self.n_units)
            self._refresh_params()
        chain.last = unit
        if not offloads:  # copies still in flight overlap these units freely: their memory is not the peak
            return None
        behind = chain.group(unit - 2)
        if behind is not None and behind.state != DONE:
            self.transfers.wait(behind.out_done)  # backpressure: at most two units of copies in flight
        group = Group(self, unit)
        chain.groups[unit] = weakref.ref(group)
        return group

    def mark_backward(self, output: object, unit: int) -> None:
        """Hook the first grad-requiring tensor of a unit's output: its gradient arriving = backward starts."""
        t = _first_grad_tensor(output)
        if t is not None and self.chain is not None:
            chain = self.chain
            t.register_hook(lambda grad: self.on_backward(chain, unit))

    # ---- backward ------------------------------------------------------------------------------------
    def on_backward(self, chain: Chain, unit: int) -> None:
        own = chain.group(unit)
        if own is not None and own.state == OFFLOADED:
            self.reload_now(own)
        for i in range(unit - 1, max(-1, unit - 1 - self.lookahead), -1):  # nearest first
            g = chain.group(i)
            if g is not None and g.state == OFFLOADED:
                self.reload_now(g)

    def reload_now(self, group: Group) -> None:
        dests = self.double_buffer.take(group) if self.double_buffer is not None else None
        group.reload(dests)

    def group_done(self, group: Group) -> None:
        if self.double_buffer is not None and group.index == 0:  # the last reload of this backward was used
            self.double_buffer.free()

    # ---- metrics -------------------------------------------------------------------------------------
    def close(self) -> None:
        self.chain = None
        self.pool.clear()
        self.double_buffer = DoubleBuffer(self.transfers) if self.double_buffer is not None else None


def _first_grad_tensor(output: object) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for item in output:
            t = _first_grad_tensor(item)
            if t is not None:
                return t
    if isinstance(output, dict):
        return _first_grad_tensor(list(output.values()))
    return None
