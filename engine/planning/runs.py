"""A model's trainable parameters as runs of identical layers, so the plan's arithmetic costs the number of
distinct layer shapes, not the depth: a 100,000-layer GPT is its embedding, one layer repeated 100,000 times
and its head. Also what the plan needs of them: the CPU-stepped suffix the split takes
(engine.optim.partition.offload_count counts it run by run), and per-layer figures as piecewise-constant
sequences (`Steps`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.optim.blockwise import blocks
from engine.optim.partition import unit_of


@dataclass(frozen=True)
class ParamRun:
    """Consecutive parameters in forward order, repeated `count` times (count > 1: consecutive layers of one
    shape, each one unit `prefix.<layer>`; repetition j is the first's layer + j)."""

    names: tuple[str, ...]  # the first repetition's
    numels: tuple[int, ...]
    units: tuple[str, ...]  # engine.optim.partition.unit_of of each name (the first repetition's)
    groups: tuple[int | str, ...]  # gradient group: the layer index (the first repetition's), "input" or "output"
    count: int = 1

    @property
    def size(self) -> int:
        return sum(self.numels)

    def layer(self, j: int) -> int:
        return self.groups[0] + j  # type: ignore[operator]  (repeated runs are layers)

    def named(self, j: int) -> list[tuple[str, int]]:
        """Repetition j's (name, numel)."""
        if j == 0:
            return list(zip(self.names, self.numels, strict=True))
        head, _, first = self.units[0].rpartition(".")
        unit = f"{head}.{int(first) + j}"
        return [(unit + n[len(self.units[0]) :], x) for n, x in zip(self.names, self.numels, strict=True)]


def runs_of(named: list[tuple[str, int]], groups: list[int | str], compress: bool = True) -> tuple[ParamRun, ...]:
    """`named` (forward order, with each one's gradient group) as runs; consecutive layers of one shape whose
    parameters form one unit of their own (`layers.7`) become one repeated run when `compress`."""
    segments: list[ParamRun] = []
    i = 0
    while i < len(named):
        j = i
        while j < len(named) and groups[j] == groups[i]:
            j += 1
        names = tuple(n for n, _ in named[i:j])
        segments.append(ParamRun(names, tuple(x for _, x in named[i:j]), tuple(unit_of(n) for n in names),
                                 tuple(groups[i:j])))  # fmt: skip
        i = j
    if not compress:
        return tuple(segments)
    used = {}  # unit -> how many segments hold it (a repeated run's units must be its own)
    for seg in segments:
        for u in set(seg.units):
            used[u] = used.get(u, 0) + 1
    out: list[ParamRun] = []
    for seg in segments:
        prev = out[-1] if out else None
        if prev is not None and _repeats(prev, seg, used):
            out[-1] = ParamRun(prev.names, prev.numels, prev.units, prev.groups, prev.count + 1)
        else:
            out.append(seg)
    return tuple(out)


def _own_layer_unit(seg: ParamRun, used: dict[str, int]) -> bool:
    """A layer whose parameters are one unit (`layers.7`) that nothing else holds."""
    unit = seg.units[0]
    return isinstance(seg.groups[0], int) and len(set(seg.units)) == 1 and used[unit] == 1 and (
        unit.rpartition(".")[2].isdigit())  # fmt: skip


def _repeats(prev: ParamRun, seg: ParamRun, used: dict[str, int]) -> bool:
    """Whether `seg` is the next layer of `prev`'s repeated run: same shapes and names, its own unit."""
    if not (_own_layer_unit(prev, used) and _own_layer_unit(seg, used)) or prev.numels != seg.numels:
        return False
    head, _, first = prev.units[0].rpartition(".")
    head2, _, idx = seg.units[0].rpartition(".")
    if not (first.isdigit() and idx.isdigit() and head == head2 and int(idx) == int(first) + prev.count):
        return False
    return seg.groups[0] == prev.groups[0] + prev.count and prev.named(prev.count) == list(  # type: ignore[operator]
        zip(seg.names, seg.numels, strict=True)
    )


@dataclass
class Suffix:
    """The last `taken` parameters of some runs (the CPU-stepped ones), as the plan needs them."""

    numel: int = 0
    largest: int = 0
    by_layer: list[tuple[int, int, int]] = field(default_factory=list)  # (first layer, end, elements per layer)
    by_side: dict[str, int] = field(default_factory=dict)  # "input" / "output" -> elements
    units: list[tuple[int, int]] = field(default_factory=list)  # (elements, how many consecutive units), forward
    unit_blocks: list[int] = field(default_factory=list)  # per entry of units: one unit's blockwise.blocks


def suffix(runs: tuple[ParamRun, ...], taken: int) -> Suffix:
    out = Suffix()
    units: list[tuple[object, int, int, int]] = []  # (key, elements, 8-bit blocks, repeats), backward order
    left = taken
    for r in reversed(runs):
        if left <= 0:
            break
        m = len(r.numels)
        whole = min(r.count, left // m) if m else r.count
        left -= whole * m
        if whole and r.count > 1:
            first = r.layer(r.count - whole)
            out.by_layer.append((first, first + whole, r.size))
            out.numel += whole * r.size
            out.largest = max(out.largest, max(r.numels, default=0))
            units.append((None, r.size, sum(map(blocks, r.numels)), whole))
        elif whole:  # count == 1: parameter by parameter below
            _take(out, units, r, 0, m, 0)
        part = min(left, m) if whole < r.count else 0
        if part:
            _take(out, units, r, m - part, m, r.count - 1 - whole)
            left -= part
    merged: list[tuple[object, int, int, int]] = []
    for key, n, b, rep in units:  # a unit split across two runs is one unit
        if merged and key is not None and merged[-1][0] == key:
            merged[-1] = (key, merged[-1][1] + n, merged[-1][2] + b, 1)
        else:
            merged.append((key, n, b, rep))
    for _, n, b, rep in reversed(merged):
        if out.units and out.units[-1][0] == n and out.unit_blocks[-1] == b:
            out.units[-1] = (n, out.units[-1][1] + rep)
        else:
            out.units.append((n, rep))
            out.unit_blocks.append(b)
    return out


def _take(out: Suffix, units: list, r: ParamRun, lo: int, hi: int, j: int) -> None:
    """Parameters lo..hi-1 of repetition j of run r, added to `out` (units in backward order)."""
    for i in reversed(range(lo, hi)):
        n, g = r.numels[i], r.groups[i]
        out.numel += n
        out.largest = max(out.largest, n)
        if isinstance(g, int):
            out.by_layer.append((g + j, g + j + 1, n))
        else:
            out.by_side[g] = out.by_side.get(g, 0) + n
        key = (r.units[i], j)
        if units and units[-1][0] == key:
            units[-1] = (key, units[-1][1] + n, units[-1][2] + blocks(n), 1)
        else:
            units.append((key, n, blocks(n), 1))


class Steps:
    """A piecewise-constant integer sequence over layers 0..n-1, built from (first, end, value) pieces whose
    overlaps add: prefix sums and values in O(log pieces)."""

    def __init__(self, n: int, pieces: Iterable[tuple[int, int, int]]) -> None:
        events: dict[int, int] = {}
        for a, b, v in pieces:
            if a < b and v:
                events[a] = events.get(a, 0) + v
                events[b] = events.get(b, 0) - v
        self.n, self.starts, self.values = n, [0], [0]
        cur = 0
        for x in sorted(events):
            if x >= n:
                break
            cur += events[x]
            if x == self.starts[-1]:
                self.values[-1] = cur
            else:
                self.starts.append(x)
                self.values.append(cur)
        ends = [*self.starts[1:], n]
        self.cum = [0]
        for s, e, v in zip(self.starts, ends, self.values, strict=True):
            self.cum.append(self.cum[-1] + v * (e - s))

    def prefix(self, i: int) -> int:
        """The sum of the first i values."""
        i = min(i, self.n)
        if i <= 0:
            return 0
        p = bisect.bisect_right(self.starts, i - 1) - 1
        return self.cum[p] + self.values[p] * (i - self.starts[p])

    @property
    def total(self) -> int:
        return self.prefix(self.n)

    def pieces(self) -> list[tuple[int, int, int]]:
        """(first, end, value) of each piece of one value."""
        ends = [*self.starts[1:], self.n]
        return [(s, e, v) for s, e, v in zip(self.starts, ends, self.values, strict=True) if s < e]
