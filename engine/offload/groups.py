"""One offload group: the tensors one forward call of one offloaded module saves for backward.

A saved tensor is stored as a *slot* (dtype, size, stride, offset) over a *stash*: the whole storage it views,
copied to a host buffer once however many slots (q, k and v of one qkv output, say) share it. In backward the
stashes come back to device memory and each slot is rebuilt as the same view of the reloaded storage, so the
gradients are bitwise those of the un-offloaded run.

Lifecycle: FORWARD (packing) -> OFFLOADED (copies issued) -> RELOADING (reload issued) -> DONE (every slot
unpacked once; host buffers back to the pool, device copies dropped).
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from engine.offload.pool import HostBuffer, HostPool
from engine.offload.transfers import HostTransfers

FORWARD, OFFLOADED, RELOADING, DONE = range(4)

# autograd nodes that only cast or re-view their single input: a saved tensor reached from a parameter through
# these alone is a copy of the weight (autocast's bf16 cast, its transpose), not an activation
_CAST_OR_VIEW = {
    "ToCopyBackward0", "TBackward0", "ViewBackward0", "PermuteBackward0", "TransposeBackward0",
    "ExpandBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "AliasBackward0",
    "CloneBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AsStridedBackward0", "SliceBackward0",
    "SelectBackward0", "DetachBackward0",
}  # fmt: skip


def is_weight_copy(t: torch.Tensor, param_ids: set[int]) -> bool:
    """True if t comes from a parameter through casts and views only (autocast's cached weight copies)."""
    fn = t.grad_fn
    for _ in range(8):
        if fn is None:
            return False
        var = getattr(fn, "variable", None)  # AccumulateGrad of a leaf
        if var is not None:
            return id(var) in param_ids
        if type(fn).__name__ not in _CAST_OR_VIEW:
            return False
        nexts = [f for f, _ in fn.next_functions if f is not None]
        if len(nexts) != 1:
            return False
        fn = nexts[0]
    return False


class Stash:
    """One storage of saved data: its host copy and, while reloaded, its device copy (uint8 views)."""

    __slots__ = ("nbytes", "host", "device")

    def __init__(self, nbytes: int, host: HostBuffer) -> None:
        self.nbytes = nbytes
        self.host: HostBuffer | None = host
        self.device: torch.Tensor | None = None


class Slot:
    """What autograd holds instead of a saved tensor: the view's geometry over a stash. No tensor reference."""

    __slots__ = ("group", "stash", "dtype", "size", "stride", "offset", "last")

    def __init__(self, group: Group, stash: Stash, t: torch.Tensor) -> None:
        self.group, self.stash = group, stash
        self.last: weakref.ref | None = None  # the tensor the last unpack returned
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()


class GroupOwner(Protocol):
    """What a group asks of the session that owns it (engine.offload.session.OffloadSession); a protocol, so
    this module does not import the session that imports it."""

    pool: HostPool
    transfers: HostTransfers
    held_bytes: int
    peak_held_bytes: int

    def should_offload(self, t: torch.Tensor) -> bool: ...
    def is_small(self, t: torch.Tensor) -> bool: ...
    def record(self, unit: int, moved: int, kept_small: int) -> None: ...
    def reload_now(self, group: Group) -> None: ...
    def group_done(self, group: Group) -> None: ...


class Group:
    """The saved tensors of one forward call of one offloaded module (see the module docstring)."""

    def __init__(self, session: GroupOwner, index: int) -> None:
        self.session = session
        self.index = index
        self.state = FORWARD
        self.stashes: list[Stash] = []
        self._by_storage: dict[StorageWeakRef, Stash] = {}  # forward only: weak, so nothing is kept alive
        self.n_slots = 0
        self.n_unpacked = 0
        self.moved_bytes = 0  # copied out by this call (for the report)
        self.kept_small = 0  # saved tensors kept on the device for being under the session's min_bytes
        # autograd skips its in-place check when hooks hold saved tensors, so it is done here (see check_versions)
        self._versions: list[tuple[weakref.ref, int]] = []
        self.out_done: object = None  # event: all offload copies finished
        self.in_done: object = None  # event: all reload copies finished

    # ---- forward -------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> object:
        s = self.session
        if not s.should_offload(t):
            self.kept_small += s.is_small(t)
            return t.detach()  # kept on the device as autograd would; detach() avoids a cycle through grad_fn
        storage = t.untyped_storage()
        key = StorageWeakRef(storage)
        stash = self._by_storage.get(key)
        if stash is None:  # first slot over this storage: copy the storage once
            nbytes = storage.nbytes()
            stash = Stash(nbytes, s.pool.lease(nbytes))
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            s.transfers.copy_out(src, stash.host)
            s.held_bytes += nbytes
            s.peak_held_bytes = max(s.peak_held_bytes, s.held_bytes)
            self.moved_bytes += nbytes
            self._by_storage[key] = stash
            self.stashes.append(stash)
        self.n_slots += 1
        self._versions.append((weakref.ref(t), t._version))
        return Slot(self, stash, t)

    def end_forward(self) -> None:
        self._by_storage.clear()
        self.session.record(self.index, self.moved_bytes, self.kept_small)
        self.out_done = self.session.transfers.record_out()
        self.state = OFFLOADED if self.n_slots else DONE

    # ---- backward ------------------------------------------------------------------------------------
    def reload(self, dests: list[torch.Tensor] | None) -> None:
        """Issue the copies back; dests are slices of a double buffer, or None to allocate per stash."""
        if self.state != OFFLOADED:
            return
        self.check_versions()
        s = self.session
        pairs = []
        for i, st in enumerate(self.stashes):
            st.device = dests[i] if dests is not None else s.transfers.alloc(st.nbytes)
            pairs.append((st.device, st.host.data[: st.nbytes]))
        self.in_done = s.transfers.copy_in(pairs, after=self.out_done)
        self.state = RELOADING

    def check_versions(self) -> None:
        """Raise as autograd would if a saved tensor still alive was changed in place after it was saved."""
        for ref, version in self._versions:
            t = ref()
            if t is not None and t._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: a tensor of shape {list(t.shape)} saved by an offloaded module is at version "
                    f"{t._version}; expected version {version} (offloading copies it when it is saved)"
                )
        self._versions = []

    def unpack(self, slot: Slot) -> torch.Tensor:
        again = slot.last() if slot.last is not None else None
        if again is not None:  # read twice while still in use (ctx.saved_tensors twice in a custom Function)
            return again
        if self.state == OFFLOADED:  # nothing prefetched it (no backward hook fired first): fetch now
            self.session.reload_now(self)
        if self.state != RELOADING:
            raise RuntimeError(
                "the offloaded saved tensors of this layer were already used and freed: backward through an "
                "offloaded layer runs once per forward (retain_graph=True is not supported with offloading)"
            )
        self.session.transfers.wait(self.in_done)
        dev = slot.stash.device
        itemsize = slot.dtype.itemsize
        out = torch.empty(0, dtype=slot.dtype, device=dev.device)
        out.set_(dev.untyped_storage(), dev.storage_offset() // itemsize + slot.offset, slot.size, slot.stride)
        if slot.last is None:  # each slot counts once
            self.n_unpacked += 1
        slot.last = weakref.ref(out)
        if self.n_unpacked == self.n_slots and self.state != DONE:
            self.finish()
        return out

    def finish(self) -> None:
        """Every slot was used: host buffers back to the pool, device copies dropped (autograd holds its own)."""
        self._release()
        self.state = DONE
        self.session.group_done(self)

    def _release(self) -> None:
        s = self.session
        for st in self.stashes:
            if st.host is not None:
                s.pool.give_back(st.host, self.in_done)
                s.held_bytes -= st.nbytes
            st.host = st.device = None
        self.stashes = []

    def __del__(self) -> None:
        # a graph dropped without backward (or only partly run): its host buffers go back all the same
        try:
            self._release()
        except Exception:
            pass
