"""GPU assist: the GPU steps some host-resident units, so the CPU threads are not the only worker.

Why: the CPU step is bound by host DRAM (about 28-30 bytes per parameter at 4-5 G params/s on the
device's 16 cores), and an exact clipped step can start only after backward. A unit stepped here
instead costs no CPU time: its fp32 master, m and v cross PCIe to a staging slot (12 bytes per
parameter, plus its gradient), the GPU steps them, the model's weights are written on the GPU, and
master, m and v go back (12 bytes). PCIe carries that at ~3.5-4.5 G params/s in each direction at
once while the CPU threads step other units, so the two together finish the CPU-resident part
sooner than the CPU alone, as far as host DRAM lets them (the copies read and write it too).
The arithmetic is torch's single-tensor AdamW ops, which on CUDA round as the CPU threads' pass does:
a unit's update is bit for bit the same whichever worker takes it.

States stay in host memory between steps; the GPU holds only 3 staging slots of the largest tensor:
3 x (16 + 2 or 4) bytes x numel (fp32 master, m, v and gradient, plus the gradient as shipped).
Units are taken from the same forward-ordered queue as the CPU threads, so each worker takes
the next layer the forward will need. Without CUDA the same code runs with host tensors and no
streams (the CPU tests' path). Besides the slots, the ops' temporaries (a few fp32 tensors of the
largest size) come from the caching allocator on the assist's stream.
"""

from __future__ import annotations

import contextlib

import torch

from engine.optim import fused_kernel
from engine.optim.adam_math import Hyper, adamw_scalars, adamw_torch_

SLOTS = 3  # staging slots: one coming in, one stepping, one going out


def assist_gpu_bytes(largest_numel: int, grad_bytes: int, slots: int = SLOTS) -> int:
    """GPU bytes the assist holds for a CPU part whose largest tensor has `largest_numel` elements: each slot's
    fp32 p, m, v and g32 plus the gradient in its dtype (`grad_bytes` per element), and the ops' fp32
    temporaries of the largest size (one per slot). The memory plan calls this; `GpuAssist` allocates it."""
    return slots * (16 + grad_bytes) * largest_numel + slots * 4 * largest_numel


class _Slot:
    def __init__(self, numel: int, device: torch.device) -> None:
        self.p, self.m, self.v, self.g32 = (torch.empty(numel, dtype=torch.float32, device=device) for _ in range(4))
        self.g: dict[torch.dtype, torch.Tensor] = {}
        self.done: torch.cuda.Event | None = None  # its results have been copied out to the host


class GpuAssist:
    def __init__(self, max_numel: int, device: torch.device, slots: int = SLOTS, host_lib=None) -> None:
        """host_lib: the CPU threads' compiled pass, used for the arithmetic where there is no CUDA."""
        self.device = device
        self.host_lib = host_lib
        self.cuda = device.type == "cuda"
        self.slots = [_Slot(max_numel, device) for _ in range(slots)]
        self.next = 0
        # copies in on one stream, arithmetic and copies out on another: tensor i+1 comes in while
        # tensor i goes out, so both PCIe directions carry traffic at once
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.in_stream = torch.cuda.Stream(device) if self.cuda else None

    def staging_bytes(self) -> int:
        s = self.slots[0]
        return len(self.slots) * (4 * s.p.numel() * 4 + sum(g.numel() * g.element_size() for g in s.g.values()))

    def step_unit(
        self,
        names: list[str],
        states: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        grads: dict[str, torch.Tensor],
        hypers: dict[str, Hyper],
        steps: dict[str, int],
        params: dict[str, torch.nn.Parameter],
        inv_scale: float,
        coef: float,
        bwd_done: torch.cuda.Event | None,
    ) -> torch.cuda.Event | None:
        """AdamW on `names` (one unit): host (master, m, v) in `states`, updated in place; steps[n] is the
        count before this step. Writes the model's weights on the GPU. Returns the event the forward waits on."""
        on = (lambda s: torch.cuda.stream(s)) if self.cuda else (lambda s: contextlib.nullcontext())
        with torch.no_grad():
            if bwd_done is not None:
                self.stream.wait_event(bwd_done)  # the last backward may still read these weights
            for n in names:
                slot = self.slots[self.next % len(self.slots)]
                self.next += 1
                if slot.done is not None:
                    # the host waits for the slot's last use to be copied out before refilling it; this also
                    # keeps the thread at most len(slots) tensors ahead, so it takes a unit only when it can start
                    slot.done.synchronize()
                p_h, m_h, v_h = states[n]
                k = p_h.numel()
                g_h = grads[n]
                if g_h.dtype not in slot.g:
                    slot.g[g_h.dtype] = torch.empty(slot.p.numel(), dtype=g_h.dtype, device=self.device)
                sp, sm, sv, sg, g32 = slot.p[:k], slot.m[:k], slot.v[:k], slot.g[g_h.dtype][:k], slot.g32[:k]
                with on(self.in_stream):
                    for dst, src in ((sp, p_h), (sm, m_h), (sv, v_h), (sg, g_h)):
                        dst.copy_(src, non_blocking=self.cuda)
                    arrived = self.in_stream.record_event() if self.cuda else None
                with on(self.stream):
                    if arrived is not None:
                        self.stream.wait_event(arrived)
                    g32.copy_(sg)
                    if inv_scale != 1.0:
                        g32.mul_(inv_scale)
                    if coef != 1.0:
                        g32.mul_(coef)  # the same two fp32 multiplies as the GPU-stepped part
                    s = adamw_scalars(hypers[n], steps[n] + 1, 1.0, 1.0)
                    if not self.cuda and self.host_lib is not None:  # host-only runs: the CPU threads' pass
                        fused_kernel.adamw_slice(self.host_lib, 0, k, sp, sm, sv, g32, None, sp, sm, sv, None, s)
                    else:
                        # torch's single-tensor ops, not its fused CUDA AdamW: on CUDA they round as the CPU
                        # threads' pass (fused_adamw.c), so a unit's result does not depend on which worker
                        # took it. ~80 bytes of HBM traffic a parameter: ~1 ms a 50 M-parameter layer.
                        adamw_torch_(sp, sm, sv, g32, None, s)
                    p = params[n]
                    p.data.copy_(sp.view(p.shape), non_blocking=self.cuda)
                    for dst, src in ((p_h, sp), (m_h, sm), (v_h, sv)):
                        dst.copy_(src, non_blocking=self.cuda)
                    slot.done = self.stream.record_event() if self.cuda else None
            return self.stream.record_event() if self.cuda else None

    def drain(self) -> None:
        """Wait until every result is back in host memory (before anything reads or writes the host states)."""
        for s in self.slots:
            if s.done is not None:
                s.done.synchronize()
                s.done = None
