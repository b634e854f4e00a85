"""Host memory of the CPU-stepped part, by part: pure arithmetic, no allocation.

The memory plan calls `cpu_side_host_bytes` for the host's optimizer parts and `CpuPart.host_bytes()`
walks the tensors the CPU part really holds; a test holds the two equal. What grows with the model:

  master, exp_avg, exp_avg_sq   12 B per CPU-stepped parameter (fp32), 8 B with bf16/fp16 moments,
                                about 6 B with block-wise 8-bit ones (1 B each + 4 B per block of 256),
                                8 B for SGD (master + momentum); the master 2 B in the remainder form
                                (store_param_remainders: remainder.py, the bf16 half is the model's weight)
  grad_staging                  one gradient per CPU-stepped parameter in the dtype it is shipped in:
                                clipping needs the global norm of every gradient before any exact update,
                                so each one waits on the host until the clip factor is known

What is bounded (by the largest layer unit or by `optimizer.speculation_buffer_mb`, not by the depth):

  weight_staging   half weights only: a ring of WEIGHT_RING pinned buffers of the largest unit, each reused
                   after its host-to-device copy has read it (fp32 weights travel from the master itself)
  grad_scratch     torch.optim's CPU step (SGD, use_torch_optimizer_for_cpu_offload): the fp32 gradient of
                   one unit at a time
  speculation      spare master/m/v (and half weights) for the units stepped out of place during backward,
                   chosen in backward order while they fit the bound; a committed unit swaps its storage
                   with its spare, so the spares' sizes never change
"""

from __future__ import annotations

from engine.optim.blockwise import NAME as BLOCKWISE
from engine.optim.blockwise import SCALE_BYTES
from engine.optim.remainder import REMAINDER_BYTES

WEIGHT_RING = 2  # half-weight upload buffers: one being filled by the CPU step while the other is copied
_FP32 = 4
# optimizer.exp_avg_dtype / exp_avg_sq_dtype -> bytes per element (the block-wise form's scales come on top)
STATE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, BLOCKWISE: 1}


def speculation_units(unit_numels: list[int], spare_bytes_per_element: int, budget_bytes: int,
                      unit_extra_bytes: list[int] | None = None) -> list[int]:  # fmt: skip
    """Indices into unit_numels of the units given a spare, in backward order (last unit first).

    A unit's spare holds spare_bytes_per_element bytes per element, plus unit_extra_bytes[i] (a block-wise 8-bit
    moment's scales); units are taken while the sum fits budget_bytes, skipping any that would not fit (a smaller
    one later may).
    """
    chosen, used = [], 0
    for i in reversed(range(len(unit_numels))):
        b = unit_numels[i] * spare_bytes_per_element + (unit_extra_bytes[i] if unit_extra_bytes else 0)
        if b and used + b <= budget_bytes:
            chosen.append(i)
            used += b
    return chosen


def _spare_bytes(unit_numels: list[int], repeats: list[int], per_elem: int, budget_bytes: int,
                 extra: list[int]) -> int:  # fmt: skip
    """The bytes of the spares `speculation_units` gives, for units given as (size, repeats) runs: a run of one
    size takes as many as still fit, which is what unit by unit would take."""
    used = 0
    for u, r, e in zip(reversed(unit_numels), reversed(repeats), reversed(extra), strict=True):
        b = u * per_elem + e
        if b:
            used += b * min(r, (budget_bytes - used) // b)
    return used


def speculates(kind: str, use_torch: bool, speculate: bool, speculation_buffer_bytes: int) -> bool:
    """Whether the CPU part steps units out of place during backward (the engine's own AdamW only)."""
    return speculate and kind == "adam" and not use_torch and speculation_buffer_bytes > 0


def cpu_side_host_bytes(
    unit_numels: list[int],
    *,
    kind: str,
    use_torch: bool,
    half_bytes: int,
    grad_bytes: int,
    speculate: bool,
    speculation_buffer_bytes: int,
    exp_avg_bytes: int = _FP32,
    exp_avg_sq_bytes: int = _FP32,
    remainders: bool = False,
    repeats: list[int] | None = None,
    coded: tuple[bool, bool] = (False, False),
    unit_blocks: list[int] | None = None,
) -> dict[str, int]:
    """Bytes of host memory the CPU-stepped part holds in steady state (after its first step), by part.

    unit_numels: elements of each CPU-stepped layer unit, forward order. kind: "adam" or "sgd".
    use_torch: torch.optim steps the host part (use_torch_optimizer_for_cpu_offload). half_bytes: 0 for
    fp32 weights, else the half dtype's size (2). grad_bytes: bytes per element of the shipped gradient.
    speculate: overlap is on (speculation needs it). exp_avg_bytes, exp_avg_sq_bytes: the moments' element
    sizes (optimizer.exp_avg_dtype, exp_avg_sq_dtype: 4 for fp32, 2 for bf16/fp16). remainders: the master
    held as int16 remainders of bf16 weights (optimizer.store_param_remainders).
    repeats: unit_numels[i] stands for repeats[i] consecutive units of that size (a deep model's identical
    layers, counted once). coded: (exp_avg, exp_avg_sq) held in the block-wise 8-bit form ("int8_blockwise":
    exp_avg_bytes 1 per element, plus blockwise.SCALE_BYTES per block); unit_blocks[i]: the quantisation blocks
    of one unit of unit_numels[i] (blockwise.blocks over its parameters), needed when a moment is coded.
    For SGD "momentum_buffer" is torch's, which exists only
    with a momentum above 0 (the plan counts it either way).
    """
    if kind not in ("adam", "sgd"):
        raise ValueError(f"kind={kind!r}: expected 'adam' or 'sgd'")
    for name, val in (("half_bytes", half_bytes), ("grad_bytes", grad_bytes),
                      ("speculation_buffer_bytes", speculation_buffer_bytes)):  # fmt: skip
        if val < 0:
            raise ValueError(f"{name}={val} is invalid: expected >= 0")
    repeats = [1] * len(unit_numels) if repeats is None else repeats
    n = sum(u * r for u, r in zip(unit_numels, repeats, strict=True))
    largest = max((u for u, r in zip(unit_numels, repeats, strict=True) if r), default=0)
    parts = {"master": (REMAINDER_BYTES if remainders else _FP32) * n}
    if any(coded) and unit_blocks is None:
        raise ValueError("a block-wise 8-bit moment needs unit_blocks (its scales are per parameter block)")
    unit_scales = [SCALE_BYTES * b for b in unit_blocks] if any(coded) else [0] * len(unit_numels)
    scales = sum(b * r for b, r in zip(unit_scales, repeats, strict=True))
    if kind == "adam":
        parts["exp_avg"] = exp_avg_bytes * n + (scales if coded[0] else 0)
        parts["exp_avg_sq"] = exp_avg_sq_bytes * n + (scales if coded[1] else 0)
    else:
        parts["momentum_buffer"] = _FP32 * n
    parts["grad_staging"] = grad_bytes * n
    parts["grad_scratch"] = _FP32 * largest if (use_torch or kind != "adam") else 0
    parts["weight_staging"] = min(WEIGHT_RING, sum(repeats)) * half_bytes * largest
    spec = 0
    if speculates(kind, use_torch, speculate, speculation_buffer_bytes):
        per_elem = (REMAINDER_BYTES if remainders else _FP32) + exp_avg_bytes + exp_avg_sq_bytes + half_bytes
        extra = [b * sum(coded) for b in unit_scales]
        spec = _spare_bytes(unit_numels, repeats, per_elem, speculation_buffer_bytes, extra)
    parts["speculation"] = spec
    return parts
