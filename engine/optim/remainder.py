"""The fp32 master held as the bf16 weight plus a 16-bit remainder (megatron-core's store_param_remainders).

The fp32 master's high 16 bits, rounded to nearest with ties away from zero, are the bf16 weight the model
computes with; its low 16 bits are the remainder (int16). A negative remainder (low half >= 0x8000) says the
high half was rounded up, so `join` rebuilds the fp32 master bit for bit from the two. Round-to-nearest-even
(torch's cast, what the fp32-master run uploads) cannot be undone from 16 bits at an exact tie (65537 masters
would share 65536 codes), hence ties away: the weights differ from that run's only at exact ties.

Host bytes: 2 per CPU-stepped parameter (the remainder) instead of 4; the bf16 weight is the model's own, read
back from the GPU into the half-weight ring at step time (into a spare's half weights for a speculative step).
These are the torch-op forms (the fallback and the
checkpoint path); the compiled pass (csrc/fused_adamw.c, rem_join/rem_split) computes the same bits.
"""

from __future__ import annotations

import torch

REMAINDER_BYTES = 2  # per CPU-stepped parameter, instead of the fp32 master's 4
_U16, _U32 = 0xFFFF, 0xFFFFFFFF


def _signed(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative int64 values below 2**bits as the two's-complement signed values of that width."""
    return x - (x >> (bits - 1)) * (1 << bits)


def join(weight: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """The fp32 master from the bf16 weight and the int16 remainder (same shape), exact."""
    hi = (weight.view(torch.int16).to(torch.int64) - (rem < 0).to(torch.int64)) & _U16
    bits = (hi << 16) | (rem.to(torch.int64) & _U16)
    return _signed(bits, 32).to(torch.int32).view(torch.float32)


def split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 weight, int16 remainder) of an fp32 master: the high half rounded to nearest, ties away from zero."""
    bits = master.contiguous().view(torch.int32).to(torch.int64) & _U32
    lo = bits & _U16
    hi = ((bits >> 16) + (lo >> 15)) & _U16
    return _signed(hi, 16).to(torch.int16).view(torch.bfloat16), _signed(lo, 16).to(torch.int16)


def join_into(out: torch.Tensor, weight: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """`join` written into the fp32 tensor `out` (same shape) in three int32 ops, allocating nothing (the GPU
    side's staging): the weight's bits shifted up plus the sign-extended remainder is the high half less one
    where the remainder is negative, over the remainder's low bits, i.e. join's bits."""
    bits = out.view(torch.int32)
    bits.copy_(weight.view(torch.int16))
    bits.bitwise_left_shift_(16)
    bits.add_(rem)
    return out


def split_from(master: torch.Tensor, weight_out: torch.Tensor, rem_out: torch.Tensor) -> None:
    """`split` of the fp32 tensor `master` into bf16 `weight_out` and int16 `rem_out` (same shapes), allocating
    nothing; `master` is consumed (left holding the rounded high half). Adding 0x8000 before the arithmetic
    shift carries bit 15 into the high half: nearest, ties away from zero, as `split` rounds."""
    bits = master.view(torch.int32)
    rem_out.copy_(bits)  # int32 -> int16 keeps the low 16 bits
    bits.add_(0x8000)
    bits.bitwise_right_shift_(16)
    weight_out.view(torch.int16).copy_(bits)
