"""Adam's moments held as block-wise 8-bit codes (optimizer.exp_avg_dtype / exp_avg_sq_dtype = "int8_blockwise").

The form of the 8-bit optimizers (Dettmers et al., "8-bit Optimizers via Block-wise Quantization"; torchao's
AdamW8bit, bitsandbytes): each parameter's moment is cut into blocks of BLOCK elements (the last one may be
short), each block stored as one uint8 code per element plus the block's absolute maximum in fp32. A code indexes
a fixed 256-entry map of values in [-1, 1] (exp_avg, signed) or [0, 1] (exp_avg_sq, unsigned): the element is
map[code] * absmax. The maps are dynamic (log-spaced by decade, linear inside one): the top decade (0.1, 1] gets
the most levels and each lower one half as many, down to 1e-6 of the block's maximum (1e-7 unsigned), so small
moments keep a relative precision a linear int8 map would lose (it rounds them to zero, and a zero second moment
under a non-zero first one is a step of lr/eps).

Quantising: x / absmax (fp32 division; a block of zeros divides by 1) rounded to the nearest map value, found as
the number of midpoints between consecutive map values that lie below it. The update itself is fp32: dequantise,
AdamW as the other forms compute it, requantise (the step uses the fp32 moments before they are rounded, as torchao
and bitsandbytes do). Blocks start at each parameter's first element, so a parameter steps on its own.

Host bytes per moment: 1 per element + SCALE_BYTES per block (`moment_bytes`); the plan calls it.
This module is the torch-op form (the fallback and the checkpoint path); csrc/fused_adamw.c's blockwise entry reads
the same tables (`tables()`) and computes the same codes from the same fp32 values.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

BLOCK = 256  # elements per scale: torchao's and bitsandbytes' block size for their 8-bit optimizers
# Device bytes per element one coded moment's step moves in these torch ops (the GPU-stepped part's form; the C pass
# reads and writes the code and its share of the maximum only): dequantise into fp32 staging 37 (maxima repeated
# 4, codes to int32 1 + 4, the map gathered 4 + 4, times the maxima 12, copied into staging 8), requantise 51 (abs
# 8, padded 8, block maxima 4, repeated 4, divided 12, searched into int32 8, narrowed to uint8 5, stored 2).
TORCH_STEP_BYTES = 88
SCALE_BYTES = 4  # one fp32 absmax per block
CODES = torch.uint8  # the dtype that marks this form where a moment's dtype is asked (options.STATE_DTYPE)
NAME = "int8_blockwise"  # the config's value


def blocks(numel: int) -> int:
    """Blocks of one parameter's moment (a short last block counts as one)."""
    return -(-numel // BLOCK)


def moment_bytes(numels: Iterable[int]) -> int:
    """Host bytes of one moment in this form for parameters of these sizes: codes and scales."""
    return sum(n + SCALE_BYTES * blocks(n) for n in numels)


def _dynamic_map(signed: bool) -> torch.Tensor:
    """256 sorted fp32 values in [-1, 1] (signed) or [0, 1]: 0, and per decade d = 0, 1, ... levels spaced evenly
    over (10^-(d+1), 10^-d], the top decade with 2^(bits-1) levels and each lower one half as many. Signed: 7
    magnitude bits (127 values a side, 1e-6 the least), the unused 256th entry a copy of 1.0 (never chosen: no
    normalised value exceeds 1). Unsigned: 8 magnitude bits (255 values, 1e-7 the least)."""
    bits = 7 if signed else 8
    mags = []
    for d in range(bits):
        levels = 1 << (bits - 1 - d)
        mags += [10.0**-d * (0.1 + 0.9 * (j + 1) / levels) for j in range(levels)]
    values = sorted([0.0] + mags + ([-x for x in mags] + [1.0] if signed else []))
    return torch.tensor(values, dtype=torch.float64).float()


SIGNED = _dynamic_map(True)  # exp_avg
UNSIGNED = _dynamic_map(False)  # exp_avg_sq


def _midpoints(qmap: torch.Tensor) -> torch.Tensor:
    """255 fp32 midpoints of consecutive map values, then +inf: a value's code is how many of them lie below it."""
    mid = (qmap[:-1].double() + qmap[1:].double()) / 2
    return torch.cat([mid.float(), torch.tensor([float("inf")])])


MIDPOINTS = {True: _midpoints(SIGNED), False: _midpoints(UNSIGNED)}


_ON_DEVICE: dict[tuple[bool, bool, torch.device], torch.Tensor] = {}  # (signed, midpoints?, device) -> table


def qmap(signed: bool, device: torch.device | None = None) -> torch.Tensor:
    """The map (on `device`, copied there once)."""
    return _table(signed, False, device)


def _table(signed: bool, midpoints: bool, device: torch.device | None) -> torch.Tensor:
    t = MIDPOINTS[signed] if midpoints else (SIGNED if signed else UNSIGNED)
    if device is None or device.type == "cpu":
        return t
    key = (signed, midpoints, device)
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = t.to(device)
    return _ON_DEVICE[key]


# The C pass finds a code without a search: an fp32 value's sign, binade (exponents below 2^-26 as one) and top 7
# mantissa bits index CELL_BITS cells, each holding at most one midpoint (checked here), so the code is the cell's
# first code, plus one where that code's midpoint lies below the value: the same count as the search.
_E_MIN, _MANT = 101, 7  # binades from 2^(101-127) = 2^-26 up; 2^7 cells per binade
CELL_BITS = 1 + 5 + _MANT


def _cell_codes(signed: bool) -> torch.Tensor:
    """uint8 per cell: how many midpoints lie below the cell's least value."""
    mid = MIDPOINTS[signed][:-1].double()
    idx = torch.arange(1 << CELL_BITS)
    sign, e, mant = idx >> (CELL_BITS - 1), (idx >> _MANT) & 31, idx & ((1 << _MANT) - 1)
    exp = (e + _E_MIN - 127).double()
    lo = torch.where(e == 0, 0.0, torch.exp2(exp) * (1 + mant / (1 << _MANT)))
    hi = torch.where(e == 0, torch.exp2(exp + 1), torch.exp2(exp) * (1 + (mant + 1) / (1 << _MANT)))
    least, most = torch.where(sign == 1, -hi, lo), torch.where(sign == 1, -lo, hi)
    first = torch.searchsorted(mid, least, right=False)  # midpoints below the cell's least value
    inside = torch.searchsorted(mid, most, right=True) - first
    if int(inside.max()) > 1:
        raise AssertionError("a cell of the 8-bit map's code table holds two midpoints: use more mantissa bits")
    return first.to(torch.uint8)


CELLS = {True: _cell_codes(True), False: _cell_codes(False)}


def tables() -> tuple[torch.Tensor, ...]:
    """For the C pass, contiguous: the signed map, its midpoints, its cell codes, then the unsigned ones."""
    return SIGNED, MIDPOINTS[True], CELLS[True], UNSIGNED, MIDPOINTS[False], CELLS[False]


def dequantise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of codes (1-D, one parameter's slice from a block boundary) with their blocks' absmax."""
    scale = absmax.repeat_interleave(BLOCK)[: codes.numel()]
    return qmap(signed, codes.device)[codes.int()] * scale


def quantise(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, absmax fp32 per block) of an fp32 1-D slice starting at a block boundary."""
    n = x.numel()
    pad = blocks(n) * BLOCK - n
    absmax = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, BLOCK).amax(1)
    div = torch.where(absmax > 0, absmax, torch.ones_like(absmax)).repeat_interleave(BLOCK)[:n]
    codes = torch.bucketize(x / div, _table(signed, True, x.device)[:-1], out_int32=True, right=False)
    return codes.to(CODES), absmax


def block_slice(a: int, b: int) -> slice:
    """The scales of elements [a, b) of one parameter (a on a block boundary)."""
    return slice(a // BLOCK, blocks(b))


# ---- checkpoints: a coded moment is saved as its codes (the parameter's shape) and "<key>_absmax" ----

MOMENTS = ("exp_avg", "exp_avg_sq")
SIGNED_MOMENT = {"exp_avg": True, "exp_avg_sq": False}


def absmax_key(key: str) -> str:
    return f"{key}_absmax"


def saved_values(st: dict, key: str) -> torch.Tensor:
    """A saved moment's values, 1-D: as stored, or its codes dequantised to fp32."""
    t = st[key].reshape(-1)
    return dequantise(t, st[absmax_key(key)], SIGNED_MOMENT[key]) if t.dtype == CODES else t


def widened(st: dict) -> dict:
    """A saved parameter state with any coded moment as fp32 values of the parameter's shape (for a part that
    does not hold this form)."""
    out = {k: v for k, v in st.items() if k not in map(absmax_key, MOMENTS)}
    for key in MOMENTS:
        if torch.is_tensor(st.get(key)) and st[key].dtype == CODES:
            out[key] = saved_values(st, key).view(st[key].shape)
    return out


def load_moment(st: dict, key: str, dest: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Set a held moment (dest, with its scales when coded) from a saved state in any form: codes copied as they
    are into the coded form, values rounded into any other (quantised to the nearest code for the coded form); a
    state saved without it (SGD's) starts at zero."""
    if not torch.is_tensor(st.get(key)):
        dest.zero_()
        if scale is not None:
            scale.zero_()
    elif scale is None:
        dest.copy_(saved_values(st, key))
    elif st[key].dtype == CODES:
        dest.copy_(st[key].reshape(-1))
        scale.copy_(st[absmax_key(key)])
    else:
        codes, absmax = quantise(st[key].reshape(-1).float(), SIGNED_MOMENT[key])
        dest.copy_(codes)
        scale.copy_(absmax)
