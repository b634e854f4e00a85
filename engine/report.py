"""What offloading did, in words for the run's summary: activation offloading per layer stack, and the optimizer.

Per stack: how many layers (or chosen sub-modules) are offloaded, the bytes one optimizer step copies to the
host and back, and the saved activations those calls hold on the host by the end of one forward pass (what
the GPU would otherwise hold then). A stack whose offloaded layers moved nothing is said so: saved tensors
at most `min_bytes` (64 KiB by default) stay on the device, so a tiny model offloads nothing at all.
"""

from __future__ import annotations

from engine.metrics import format_bytes
from engine.offload.wrap import OffloadHandle
from engine.optim.protocol import EngineOptimizer


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


def optimizer_lines(optimizer: EngineOptimizer, micro_batches: int = 1) -> list[str]:
    """One line for an optimizer that steps parameters on the CPU (EngineOptimizer.cpu_offload); [] otherwise."""
    c = optimizer.cpu_offload(micro_batches)
    if c is None:
        return []
    return [
        f"optimizer offload: {c.cpu_params:,} of {c.total_params:,} parameters "
        f"({100.0 * c.cpu_params / max(1, c.total_params):.1f}%) stepped on the CPU: {format_bytes(c.gpu_bytes_freed)} "
        f"of master weights and optimizer states off the GPU, {format_bytes(c.bytes_per_step)} per step (gradients "
        "to the host, weights back)"
    ]
