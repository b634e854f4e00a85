"""The peak of the bytes torch's ops allocate while a block runs on the CPU, counted storage by storage: what a
memory figure of the plan (or a mechanism's own) is held against where no CUDA allocator records peaks."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakBytes(TorchDispatchMode):
    """`with PeakBytes() as p: ...; p.peak`: the most bytes alive at once among storages created by ops inside the
    block (forward and backward; views and in-place results of an op's inputs are not new storages, so tensors
    that existed before, such as parameters, never count). grads_of: parameters whose `.grad` is left out (the plan
    counts gradients as a part of their own)."""

    def __init__(self, grads_of: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}
        self.peak = 0
        self.grads_of = grads_of

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {StorageWeakRef(t.untyped_storage()) for t in tensors}
        self.live = {k: n for k, n in self.live.items() if not k.expired()}  # before a freed address is reused
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                key = StorageWeakRef(t.untyped_storage())
                if key not in self.live and key not in inputs:
                    self.live[key] = t.untyped_storage().nbytes()
        grads = {StorageWeakRef(p.grad.untyped_storage()) for p in self.grads_of if p.grad is not None}
        self.peak = max(self.peak, sum(n for k, n in self.live.items() if k not in grads))
        return out
