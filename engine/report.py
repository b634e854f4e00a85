"""What offloading did, in words for the run's summary: activation offloading per layer stack, and the optimizer.

Per stack: how many layers (or chosen sub-modules) are offloaded, the bytes one optimizer step copies to the
host and back, and the saved activations those calls hold on the host by the end of one forward pass (what
the GPU would otherwise hold then). A stack whose offloaded layers moved nothing is said so: saved tensors
at most `min_bytes` (64 KiB by default) stay on the device, so a tiny model offloads nothing at all.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.metrics import format_bytes
from engine.offload.wrap import OffloadHandle

_HALF = (torch.bfloat16, torch.float16)


def stack_lines(handle: OffloadHandle | None, forwards_per_step: int = 1, what: str = "layers") -> list[str]:
    """One line per layer stack with offloaded units; [] when nothing is offloaded."""
    if handle is None or handle.session is None:
        return []
    s = handle.session
    n_offloaded = len(handle.offloaded)  # offloaded units are the first ones (all of them when fine-grained)
    lines = []
    for path in dict.fromkeys(handle.unit_paths):
        units = [u for u, p in enumerate(handle.unit_paths) if p == path]
        mine = [u for u in units if u < n_offloaded]
        if not mine:
            continue
        head = f"activation offload {path}: {len(mine)} of {len(units)} {what} wrapped"
        calls = max(s.calls[u] for u in mine)
        if calls == 0:
            lines.append(f"{head} (not run yet)")
            continue
        per_step = sum(s.moved_bytes[u] / max(1, s.calls[u]) for u in mine) * forwards_per_step
        if per_step == 0:
            kept = sum(s.kept_small[u] for u in mine) // calls
            lines.append(
                f"{head}, but nothing moved: each saved tensor ({kept} per forward) is at most {s.min_bytes} bytes "
                "(offload.DEFAULT_MIN_BYTES) or a parameter, so it stays on the device; larger batch x sequence "
                "x hidden sizes are what offloading moves"
            )
            continue
        held = sum(s.peak_call_bytes[u] for u in mine)
        lines.append(
            f"{head}: {format_bytes(per_step)} to the host and back per step, "
            f"{format_bytes(held)} of saved activations off the GPU by the end of forward"
        )
    return lines


def optimizer_lines(optimizer: Any, micro_batches: int = 1) -> list[str]:
    """One line for a HybridDeviceOptimizer (also inside the distributed optimizer) that steps parameters on
    the CPU: their share, the GPU bytes their master weights and states no longer take, the bytes per step."""
    hybrid = getattr(optimizer, "inner", optimizer)
    names = getattr(hybrid, "cpu_names", None)
    if not names:
        return []
    params = [hybrid.params_by_name[n] for n in names]
    total = sum(p.numel() for p in hybrid.params_by_name.values())
    numel = sum(p.numel() for p in params)
    per_state = {"adam": 8, "sgd": 4}.get(getattr(hybrid, "kind", "adam"), 8)
    saved = sum(p.numel() * (per_state + (4 if p.dtype in _HALF else 0)) for p in params)  # states + fp32 master
    fp32_sums = micro_batches > 1 and getattr(hybrid, "accumulate_grads_in_fp32", False)
    moved = sum(p.numel() * ((4 if fp32_sums and p.dtype in _HALF else p.element_size()) + p.element_size())
                for p in params)  # fmt: skip
    return [
        f"optimizer offload: {numel:,} of {total:,} parameters ({100.0 * numel / max(1, total):.1f}%) stepped on "
        f"the CPU: {format_bytes(saved)} of master weights and optimizer states off the GPU, "
        f"{format_bytes(moved)} per step (gradients to the host, weights back)"
    ]
