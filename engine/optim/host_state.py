"""Host state of the CPU-stepped part and its buffers: where every host tensor lives, nothing about when.

Per layer unit (the parameters whose update travels back together, in forward order):
  a `Bank`          the unit's fp32 master (or the int16 remainders of its bf16 weights: remainder.py), exp_avg
                    and exp_avg_sq as flat tensors of its elements, views by name; a moment in the block-wise
                    8-bit form (blockwise.py) also has its per-block scales, each parameter's blocks from its
                    first element.
                    Home banks are slices of one flat buffer per role (few, exact pinned allocations).
  spares            banks of the same sizes held apart for the speculative step (`SparePool`): a unit is
                    stepped out of place into a free spare of its size; commit swaps the unit's bank with
                    the spare (the old bank becomes the spare), so the pool's sizes never change. Which units
                    get one is fixed by the bound (host_plan.speculation_units), in backward order.
  grad staging      one buffer per shipped dtype holding every CPU-stepped gradient: clipping needs all of
                    them before any exact update, so they wait here until the clip factor is known.
  weight ring       half weights: WEIGHT_RING buffers of the largest unit, the in-place step writes a unit's
                    half weights into one and the host-to-device copy reads them; a buffer is reused only
                    after that copy's event (fp32 weights travel from the master itself, which is pinned).
  grad scratch      torch.optim's step only: one unit's fp32 gradient at a time.
`host_bytes()` walks these tensors; host_plan.cpu_side_host_bytes predicts the same sum without allocating.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from engine.optim import blockwise, remainder
from engine.optim.host_buffers import FlatViews, flat_buffer
from engine.optim.host_plan import WEIGHT_RING, speculation_units


@dataclass
class Bank:
    """One unit's state: flat tensors of the unit's elements (m and v absent when torch.optim owns them), and the
    per-block scales of a moment held as block-wise 8-bit codes (ms, vs; else None)."""

    p: torch.Tensor
    m: torch.Tensor | None
    v: torch.Tensor | None
    ms: torch.Tensor | None = None
    vs: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.p, self.m, self.v, self.ms, self.vs) if t is not None]


@dataclass
class Spare:
    """A spare bank for out-of-place steps and the half weights it produces (None for fp32 weights)."""

    bank: Bank
    half: torch.Tensor | None
    read_by: torch.cuda.Event | None = None  # the host-to-device copy that last read `half`


@dataclass
class RingSlot:
    """A half-weight upload buffer of the largest unit's size."""

    half: torch.Tensor
    read_by: torch.cuda.Event | None = None


@dataclass(frozen=True)
class Layout:
    """Where each parameter sits: its unit, its offset inside the unit, its shape; units in forward order."""

    units: dict[str, list[str]]
    unit_of: dict[str, str]
    offset: dict[str, int]  # inside its unit
    shape: dict[str, torch.Size]
    numel: dict[str, int]  # per unit

    @staticmethod
    def of(entries: list[tuple[str, torch.Size, str]]) -> Layout:
        """entries: (name, shape, unit) in forward order, each unit's names contiguous."""
        units: dict[str, list[str]] = {}
        offset, shape, numel = {}, {}, {}
        last = None
        for n, s, u in entries:
            if n in shape:
                raise ValueError(f"parameter {n!r} appears twice")
            if u in units and u != last:
                raise ValueError(f"unit {u!r}'s parameters are not contiguous in forward order (at {n!r})")
            last = u
            units.setdefault(u, []).append(n)
            offset[n] = numel.get(u, 0)
            shape[n] = s
            numel[u] = offset[n] + s.numel()
        return Layout(units, {n: u for u, ns in units.items() for n in ns}, offset, shape, numel)

    def views(self, flat: torch.Tensor, unit: str) -> dict[str, torch.Tensor]:
        """Per-name 1-D views of a flat tensor laid out as `unit`."""
        return {n: flat[self.offset[n] : self.offset[n] + self.shape[n].numel()] for n in self.units[unit]}


class SparePool:
    """Spare banks by size; taken by the speculative step (driver thread), given back by commit or discard."""

    def __init__(self, spares: list[Spare]) -> None:
        self._free: dict[int, list[Spare]] = {}
        for s in spares:
            self._free.setdefault(s.bank.p.numel(), []).append(s)
        self._lock = threading.Lock()  # the driver and the GPU assist's thread both commit

    def take(self, numel: int) -> Spare | None:
        with self._lock:
            free = self._free.get(numel)
            spare = free.pop() if free else None
        if spare is not None and spare.read_by is not None:
            spare.read_by.synchronize()  # its half weights were the source of a copy that may still run
            spare.read_by = None
        return spare

    def give_back(self, spare: Spare) -> None:
        with self._lock:
            self._free[spare.bank.p.numel()].append(spare)

    def sizes(self) -> list[int]:
        """numel of each free spare (all of them between steps)."""
        with self._lock:
            return sorted(n for n, free in self._free.items() for _ in free)


class HostState:
    def __init__(
        self,
        layout: Layout,
        *,
        moments: bool,
        half: torch.dtype | None,
        pin_master: bool,
        pin_moments: bool,
        pin_half: bool,
        pin_grads: bool,
        spare_budget_bytes: int,
        grad_scratch: bool,
        moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
        remainders: bool = False,
    ) -> None:
        """moments: hold exp_avg and exp_avg_sq (the engine's AdamW; torch.optim keeps its own).
        half: the model's half dtype, or None for fp32 weights. spare_budget_bytes: host memory for the
        speculative step's spares (0: none). grad_scratch: one unit's fp32 gradient for torch.optim.
        moment_dtypes: (exp_avg, exp_avg_sq) storage dtypes: fp32, bf16, fp16, or blockwise.CODES (the block-wise
        8-bit form, its scales held beside).
        remainders: the master is held as int16 remainders of the bf16 weights (remainder.py), which the caller
        reads back from the model into the weight ring (a spare's half weights, for an out-of-place step)."""
        if remainders and half != torch.bfloat16:
            raise ValueError("the remainder form needs bf16 weights")
        self.remainders = remainders
        self.layout = layout
        self.half = half
        self.pin_grads = pin_grads
        units = list(layout.units)
        flat_layout, o = {}, 0
        for u in units:
            for n in layout.units[u]:
                flat_layout[n] = (o, layout.shape[n])
                o += layout.shape[n].numel()
        self._flat_layout = flat_layout
        # the home buffers (pinned or not as asked); after a commit a unit's bank may be a spare's slice and a
        # home slice a spare, so read a parameter's state through state(name), not these buffers' views
        self.master = FlatViews(flat_layout, torch.int16 if remainders else torch.float32, pin_master)
        if remainders:
            self.master.flat.zero_()  # the bf16 weights as they are: the masters they round from, exactly
        self.moment_dtypes = moment_dtypes
        self.m = FlatViews(flat_layout, moment_dtypes[0], pin_moments) if moments else None
        self.v = FlatViews(flat_layout, moment_dtypes[1], pin_moments) if moments else None
        # a block-wise 8-bit moment's scales: each parameter's blocks, parameters in the same order
        block_layout, self._block_offset, self.unit_blocks, o = {}, {}, {}, 0
        for u in units:
            first = o
            for n in layout.units[u]:
                k = blockwise.blocks(layout.shape[n].numel())
                block_layout[n], self._block_offset[n] = (o, torch.Size([k])), o - first
                o += k
            self.unit_blocks[u] = o - first
        self.coded = tuple(moments and d == blockwise.CODES for d in moment_dtypes)  # (exp_avg, exp_avg_sq)
        self.ms, self.vs = (FlatViews(block_layout, torch.float32, pin_moments) if c else None for c in self.coded)
        home = [self.master.flat, *((self.m.flat, self.v.flat) if moments else (None, None))]
        scales = [t.flat if t is not None else None for t in (self.ms, self.vs)]
        self.bank: dict[str, Bank] = {}
        self._views: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]] = {}
        self._scale_views: dict[str, dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]] = {}
        off = boff = 0
        for u in units:
            n, k = layout.numel[u], self.unit_blocks[u]
            self.bank[u] = Bank(*(t[off : off + n] if t is not None else None for t in home),
                                *(t[boff : boff + k] if t is not None else None for t in scales))  # fmt: skip
            self._refresh(u)
            off, boff = off + n, boff + k
        for t in home[1:] + scales:  # zero moments (zero scales: every code reads as zero)
            if t is not None:
                t.zero_()
        self.steps: dict[str, int] = dict.fromkeys(layout.unit_of, 0)
        self.grads: dict[torch.dtype, FlatViews] = {}  # shipped dtype -> every gradient, allocated on first use
        largest = max(layout.numel.values(), default=0)
        ring = min(WEIGHT_RING, len(units)) if half is not None else 0
        self.ring = [RingSlot(flat_buffer(largest, half, pin_half)) for _ in range(ring)]
        self._next_slot = 0
        self.scratch = flat_buffer(largest if grad_scratch else 0, torch.float32, False)
        spares, self.spare_flat = self._make_spares(units, moments, pin_master, pin_moments, pin_half,
                                                    spare_budget_bytes)  # fmt: skip
        self.spares = SparePool(spares)

    def _make_spares(
        self, units, moments, pin_master, pin_moments, pin_half, budget
    ) -> tuple[list[Spare], list[torch.Tensor]]:
        """The spares (backward order while they fit the budget) and the flat buffers they are slices of."""
        if not moments or budget <= 0:
            return [], []
        half_bytes = 0 if self.half is None else torch.empty(0, dtype=self.half).element_size()
        numels = [self.layout.numel[u] for u in units]
        master = torch.int16 if self.remainders else torch.float32
        per_elem = master.itemsize + sum(d.itemsize for d in self.moment_dtypes) + half_bytes
        scale_bytes = [blockwise.SCALE_BYTES * sum(self.coded) * self.unit_blocks[u] for u in units]
        chosen = [units[i] for i in speculation_units(numels, per_elem, budget, scale_bytes)]
        total, total_blocks = sum(self.layout.numel[u] for u in chosen), sum(self.unit_blocks[u] for u in chosen)
        p = flat_buffer(total, master, pin_master)
        m, v = (flat_buffer(total, d, pin_moments) for d in self.moment_dtypes)
        ms, vs = (flat_buffer(total_blocks, torch.float32, pin_moments) if c else None for c in self.coded)
        h = flat_buffer(total, self.half, pin_half) if self.half is not None else None
        spares, off, boff = [], 0, 0
        for u in chosen:
            sl, bl = slice(off, off + self.layout.numel[u]), slice(boff, boff + self.unit_blocks[u])
            bank = Bank(p[sl], m[sl], v[sl], *(t[bl] if t is not None else None for t in (ms, vs)))
            spares.append(Spare(bank, h[sl] if h is not None else None))
            off, boff = sl.stop, bl.stop
        return spares, [t for t in (p, m, v, ms, vs, h) if t is not None]

    # ---- views ----
    def _refresh(self, unit: str) -> None:
        b, lay = self.bank[unit], self.layout
        pv = lay.views(b.p, unit)
        mv = lay.views(b.m, unit) if b.m is not None else dict.fromkeys(pv)
        vv = lay.views(b.v, unit) if b.v is not None else dict.fromkeys(pv)
        self._views[unit] = {n: (pv[n], mv[n], vv[n]) for n in lay.units[unit]}
        self._scale_views[unit] = self._block_views(b, unit)

    def _block_views(self, b: Bank, unit: str) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
        def views(t):
            if t is None:
                return dict.fromkeys(self.layout.units[unit])
            return {n: t[self._block_offset[n] : self._block_offset[n] + blockwise.blocks(self.layout.shape[n].numel())]
                    for n in self.layout.units[unit]}  # fmt: skip

        ms, vs = views(b.ms), views(b.vs)
        return {n: (ms[n], vs[n]) for n in self.layout.units[unit]}

    def state(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The current (master, exp_avg, exp_avg_sq) 1-D views of one parameter."""
        return self._views[self.layout.unit_of[name]][name]

    def scales(self, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The current per-block scales of one parameter's (exp_avg, exp_avg_sq): None for a moment not coded."""
        return self._scale_views[self.layout.unit_of[name]][name]

    def spare_views(self, spare: Spare, unit: str) -> dict[str, tuple[torch.Tensor | None, ...]]:
        """name -> the spare's (master, exp_avg, exp_avg_sq, exp_avg scales, exp_avg_sq scales) views."""
        lay, b = self.layout, spare.bank
        p, m, v = (lay.views(t, unit) for t in (b.p, b.m, b.v))
        scales = self._block_views(b, unit)
        return {n: (p[n], m[n], v[n], *scales[n]) for n in lay.units[unit]}

    def half_views(self, flat: torch.Tensor, unit: str) -> dict[str, torch.Tensor]:
        return self.layout.views(flat, unit)

    # ---- speculation ----
    def commit(self, unit: str, spare: Spare) -> None:
        """The spare's bank (stepped out of place) becomes the unit's; the unit's old bank becomes the spare's."""
        self.bank[unit], spare.bank = spare.bank, self.bank[unit]
        self._refresh(unit)

    # ---- state by name (no step in flight) ----
    def export(self, name: str, weight: torch.Tensor | None = None) -> dict:
        """step, master and (when held here) exp_avg, exp_avg_sq: fresh tensors of the parameter's shape.
        weight: the parameter's bf16 weight (on any device), which the remainder form's master needs."""
        shape = self.layout.shape[name]
        p, m, v = self.state(name)
        if self.remainders:
            p = remainder.join(weight.detach().reshape(-1).cpu(), p)
        st: dict = {"step": self.steps[name], "master": p.view(shape).clone()}
        if m is not None:
            st["exp_avg"] = m.view(shape).clone()
            st["exp_avg_sq"] = v.view(shape).clone()
            for key, scale in zip(blockwise.MOMENTS, self.scales(name), strict=True):
                if scale is not None:  # saved in its form: the codes (above) and their blocks' absmax
                    st[blockwise.absmax_key(key)] = scale.clone()
        return st

    def load(self, name: str, st: dict) -> torch.Tensor | None:
        """Returns, for the remainder form, the bf16 weight the saved master splits into (the caller's to set)."""
        self.steps[name] = int(st["step"])
        p, m, v = self.state(name)
        weight = None
        if self.remainders:
            weight, rem = remainder.split(st["master"].reshape(-1).float())
            p.copy_(rem)
        else:
            p.copy_(st["master"].reshape(-1))
        if m is not None:  # a state saved without moments (SGD's) starts them at zero
            for key, t, scale in zip(blockwise.MOMENTS, (m, v), self.scales(name), strict=True):
                blockwise.load_moment(st, key, t, scale)
        return weight

    # ---- staging ----
    def grad_buffer(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self.grads:
            self.grads[dtype] = FlatViews(self._flat_layout, dtype, self.pin_grads)
        return self.grads[dtype][name]

    def take_ring(self, wait: bool = True, avoid: RingSlot | None = None) -> RingSlot:
        """The next half-weight upload buffer (driver thread only), once the copy that last read it is done; or,
        without wait, at once, its read_by left for the caller to order its own copy after on the GPU. avoid: a
        slot still held (a unit whose weights are read back ahead of its step), passed over."""
        if self.ring[self._next_slot] is avoid:
            self._next_slot = (self._next_slot + 1) % len(self.ring)
        slot = self.ring[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self.ring)
        if wait and slot.read_by is not None:
            slot.read_by.synchronize()
            slot.read_by = None
        return slot

    def tensors(self) -> list[torch.Tensor]:
        """Every host tensor held here (flat buffers, not views)."""
        out = [v.flat for v in (self.master, self.m, self.v, self.ms, self.vs) if v is not None]
        out += [g.flat for g in self.grads.values()] + [s.half for s in self.ring] + [self.scratch]
        return out + self.spare_flat
