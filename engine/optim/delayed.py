"""optimizer.delayed_param_update: the CPU-stepped part's update lands one step late (ZeRO-Offload's DPU).

Opt-in, because it changes the numerics. Steps are numbered s = 0, 1, ...; `taken` counts those that
stepped (a non-finite step is skipped and does not count).

  warm-up       while taken < warmup, steps are exact: the CPU part's update of step s is in the weights
                before step s+1's forward reads them (per layer, as without this option).
  delayed       afterwards, the CPU part's update computed from step s's gradients runs on the host threads
                during step s+1's forwards and backwards and is copied into a GPU shadow of those weights;
                step s+1's clip_and_step, after its last backward, copies the shadow into the weights, so
                step s+2's forward reads them and no layer's weights change between its forward and backward.
  gradients     step s's gradients (of every parameter) are computed on weights in which the CPU part lacks
  and weights   exactly one update, step s-1's; the GPU part's weights are exact. Each update applies to the
                masters the same arithmetic as without the option, with step s's learning rate, loss scale and
                clip factor: master_{s+1} = U(master_s, g_s). Only when the CPU part's weights see it differs.
  clipping      the global norm of step s includes the CPU part's gradients of step s; its clip factor scales
                both parts' updates of step s.
  non-finite    a step with a non-finite gradient updates nothing (as without the option) and drops the CPU
                part's gradients of that step; step s-1's update, computed from finite gradients, still lands
                there, so the next step's forward reads the masters.
  checkpoint    saved after step s: the masters and optimizer states after step s's update (saving waits for
                it), the model's weights as step s+1's forward reads them (one update behind in the CPU part)
                and `pending`, the names whose weights lag. Loaded with this option at the same split, the
                model's weights are kept and the shadow is made from the masters (rounded as the step rounds
                them), so step s+1 lands it as the uninterrupted run would: a resumed run continues bit for
                bit. Loaded otherwise (option off, another fraction), the pending update lands at load.
  remainders    with the remainder master (store_param_remainders) the master is its bf16 weight plus a
                remainder. The step reads the weights back after the previous update landed in them, so they
                are the masters' high halves then; while an update is pending the high halves are the shadow,
                which checkpoints save from and resume into.

Memory: the shadow holds the CPU part's weights once more on the GPU, in their dtype (2 B per CPU-stepped
parameter with bf16 weights); a step's exposed host wait becomes at most what the CPU step takes beyond one
whole step's GPU work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

# ZeRO-Offload (Ren et al., USENIX ATC 2021, section 4.2) turns DPU on only after the first few dozen
# iterations, because the gradients change fastest at the start of training and a stale update hurts most
# there; its GPT-2 and BERT runs use 40 exact steps first, and so does the default here.
DEFAULT_WARMUP = 40


def shadow_gpu_bytes(cpu_numel: int, weight_bytes: int) -> int:
    """GPU bytes of the shadow: every CPU-stepped weight once more, in the weights' dtype (`weight_bytes` per
    element). The memory plan calls this; `DelayedUpdate.bind` allocates it."""
    return weight_bytes * cpu_numel


class DelayedUpdate:
    """The shadow weights, the warm-up count and whether an update is in flight; hybrid.py drives it."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.taken = 0  # steps that stepped
        self.pending = False  # the last launched update writes the shadow and has not landed yet
        self.shadow: dict[str, torch.Tensor] = {}
        self.params: dict[str, torch.nn.Parameter] = {}

    def bind(self, params: dict[str, torch.nn.Parameter]) -> None:
        """The CPU-stepped parameters: a shadow of each, on its device and in its dtype."""
        self.params = params
        with torch.no_grad():
            self.shadow = {n: p.detach().clone() for n, p in params.items()}

    def delays(self) -> bool:
        """Whether the step about to launch is delayed (the warm-up is over)."""
        return self.taken >= self.warmup

    def targets(self) -> dict[str, torch.Tensor]:
        """Where a delayed update's weights go: the shadow, by name."""
        return self.shadow

    @torch.no_grad()
    def land(self, wait_units: Callable[[], None]) -> None:
        """Copy the in-flight update into the weights, after this step's last backward (main thread).

        wait_units: waits until every unit's update is written to the shadow (on the host, and on the current
        stream for the copies to the GPU), so the copies below run after them in stream order."""
        if not self.pending:
            return
        wait_units()
        names = list(self.params)
        torch._foreach_copy_([self.params[n] for n in names], [self.shadow[n] for n in names])
        self.pending = False

    def finish_step(self, stepped: bool, delayed: bool) -> None:
        if stepped:
            self.taken += 1
            self.pending = delayed

    # ---- state ----
    def state(self) -> dict:
        return {"taken": self.taken, "warmup": self.warmup, "pending": sorted(self.params) if self.pending else []}

    @torch.no_grad()
    def load(self, state: dict | None, saved_steps: Iterable[int], masters: dict[str, torch.Tensor]) -> set[str]:
        """Restore the count and any pending update; returns the names whose weights must not be set from masters.

        state: this class's `state()` from the checkpoint (None for one saved without the option: the count is
        then the most steps any parameter took). masters: the loaded fp32 masters of the CPU-stepped part."""
        self.taken = int(state["taken"]) if state else max(saved_steps, default=0)
        pending = set(state["pending"]) if state else set()
        self.pending = bool(pending) and pending == set(self.params)
        if not self.pending:
            return set()  # nothing pending, or saved at another split: the weights come from the masters
        for n, s in self.shadow.items():
            s.copy_(masters[n].reshape(s.shape).to(s.dtype))  # as the step rounds the master to the weight
        return pending
