"""Which parameters the CPU steps, and the layer units that updates travel back in.

The split takes parameters from the output end of the model (the end of `named_parameters()`,
which is forward order for a module that registers its layers in the order it calls them) until
`fraction` of all elements is reached. Why the output end: backward produces those gradients
first, so their device-to-host copies start earliest, and the next forward uses those weights
last, so the CPU step and the host-to-device copy of a layer have the whole forward of every
GPU-stepped layer before them to hide behind. The boundary tensor goes to whichever side leaves
the element count nearer the target, so the split is exact to within half of one tensor.
"""

from __future__ import annotations

import torch


def split_for_offload(named: list[tuple[str, torch.Tensor]], fraction: float) -> set[str]:
    """Names of the parameters stepped on the CPU: the output-side run of `named` holding ~fraction of elements."""
    taken = offload_count([(tuple(p.numel() for _, p in named), 1)], fraction)
    return {name for name, _ in named[len(named) - taken :]}


def offload_count(runs: list[tuple[tuple[int, ...], int]], fraction: float) -> int:
    """How many parameters, from the output end, the CPU steps at `fraction`: each is taken while the element
    count is short of the target and taking it overshoots by no more than leaving it undershoots.

    runs: the element counts in forward order as (one repetition's counts, repetitions), so the memory plan of
    a deep model of identical layers asks without listing them; whole repetitions are counted by bisection
    (taking gets harder as the count grows)."""
    target = fraction * sum(sum(t) * c for t, c in runs)

    def takes(acc: int, n: int) -> bool:
        return not (acc >= target or acc + n - target > target - acc)

    def whole(acc: int, rev: tuple[int, ...]) -> bool:  # every count of one repetition taken from `acc` on
        for n in rev:
            if not takes(acc, n):
                return False
            acc += n
        return True

    acc = taken = 0
    for template, count in reversed(runs):
        rev, size = template[::-1], sum(template)
        lo, hi = 0, count  # the repetitions taken whole
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if whole(acc + (mid - 1) * size, rev):
                lo = mid
            else:
                hi = mid - 1
        acc, taken = acc + lo * size, taken + lo * len(template)
        if lo < count:  # the first repetition not taken whole: its tail
            for n in rev:
                if not takes(acc, n):
                    return taken
                acc, taken = acc + n, taken + 1
    return taken


def forward_order(names: list[str]) -> list[str]:
    """Names regrouped by layer unit, units in order of first appearance, names in their given order.

    Param groups list parameters group by group (decayed matrices, then biases and norms), each
    group in model order; regrouping by unit restores the model's layer order across groups.
    """
    rank: dict[str, int] = {}
    for n in names:
        rank.setdefault(unit_of(n), len(rank))
    return sorted(names, key=lambda n: rank[unit_of(n)])  # stable: keeps the given order inside a unit


def unit_of(name: str) -> str:
    """The module a parameter's update is awaited on: the first indexed block (`layers.3`) or top-level child.

    `layers.3.attn.qkv.weight` -> `layers.3`; `output.weight` -> `output`; `bias` (on the root) -> ``.
    """
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if len(parts) > 1 else ""
