"""One pass of AdamW over narrow states on CUDA: a Triton kernel that reads each parameter's weight, remainder or
fp32 master, gradient and moments once, and writes them back once (gpu_narrow.NarrowGpuPart's step where it runs).

Why a hand kernel: the staged step (widen a slice to fp32, torch's fused AdamW, round back, join and split the
remainder in int32 ops) moves ~110 B per parameter; this one moves what is stored (`one_pass_bytes`: 18 for bf16
moments + remainder and bf16 gradients, against ~48 for the fp32 part's cast, two scalings, fused step and weight
refresh). torch.compile was weighed and not taken: inductor emits Triton's approximate fp32 division and lets the
compiler contract multiplies into FMAs, so its bits would not be the fused AdamW's.

Its arithmetic is torch's fused AdamW's own (aten/src/ATen/native/cuda/fused_adam_utils.cuh), op for op, so that
the remainder master stays bit-equal to the fp32 master of the fp32 GPU part (gpu_side.GpuPart) on the same device.
torch has shipped two such arithmetics (`Math`):
- FLOAT (torch releases with "Use opmath_t and not double compute in fused SGD and Adam"): fp32 scalars;
  m = fma(b1, m, fma(-b1, g, g)); v = fma(b2, v, fma(-b2, g*g, g*g)); the weight decay p - (lr*wd)*p, which nvcc
  may contract into fma(-(lr*wd), p, p) (`wd_fma`).
- DOUBLE (earlier releases): double scalars; the decay, m = b1*m + (1-b1)*g and v = b2*v + (1-b2)*g*g in double,
  rounded to fp32. Which product nvcc fuses into an FMA here changes the double result by an ulp, and the fp32 one
  only where that double lies within an ulp of an fp32 rounding boundary (~1e-8 of elements); this kernel fuses
  b1*m and b2*v (LLVM's choice for a sum of two products).
Both: bias corrections 1 - beta**step in the fused kernel's precision (computed by torch.pow on the device, the same
pow torch's kernel calls), step_size = lr / bc1, denom = sqrt(v) / sqrt(bc2) + eps, p -= step_size * m / denom with
IEEE division and square root (div_rn, sqrt_rn: Triton's plain `/` on fp32 is approximate), no other contraction
(the kernel is compiled with enable_fp_fusion=False). `device_math` runs each candidate against torch's fused AdamW
on a probe at first use and keeps the one that matches bit for bit; None (no Triton, not CUDA, no match) keeps the
staged step. Moments are stored rounded to nearest even; the remainder split is remainder.split_from's.

GPU bytes: none beyond the states (no staging); a few scalars per group and step count.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch
from torch.optim.adamw import adamw

from engine.optim.adam_math import Hyper

try:  # Triton ships with CUDA builds of torch; CPU-only ones have none (the staged step runs there)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_log = logging.getLogger(__name__)
BLOCK = 2048  # elements per program: 8 warps, 8 elements (16 B of bf16) a thread per load
FP32_MASTER, HALF_MASTER, REMAINDER = 0, 1, 2  # the weight is the fp32 master / an fp32 master beside it / + remainder


class Math(NamedTuple):
    """Which of torch's fused AdamW arithmetics the kernel computes (module docstring)."""

    double: bool
    wd_fma: bool


FLOAT, FLOAT_UNFUSED, DOUBLE = Math(False, True), Math(False, False), Math(True, True)
CANDIDATES = (FLOAT, FLOAT_UNFUSED, DOUBLE)


def one_pass_bytes(*, moment_bytes: tuple[int, int], master: int, grad_bytes: int, weight_bytes: int = 2) -> int:
    """Device bytes one parameter's one-pass step reads and writes: the moments and the master (the fp32 weight,
    an fp32 master and the half weight written from it, or the bf16 weight + int16 remainder) each way, the gradient
    read."""
    held = {FP32_MASTER: 8, HALF_MASTER: 8 + weight_bytes, REMAINDER: 8}[master]
    return 2 * sum(moment_bytes) + grad_bytes + held


if triton is not None:

    @triton.jit
    def _store_rounded(ptr, x, mask):
        """x (fp32) stored in ptr's dtype, rounded to nearest even; to bf16 by its bits (torch's own rounding,
        NaN as torch's 0x7FC0), which Triton's interpreter would truncate."""
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.int32, bitcast=True)
            hi = tl.where(x != x, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
            tl.store(ptr, hi.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _adamw_pass(w_ptr, master_ptr, rem_ptr, g_ptr, m_ptr, v_ptr, s_ptr, n, inv_scale, coef,
                    MASTER: tl.constexpr, DOUBLE: tl.constexpr, WD_FMA: tl.constexpr, DECAY: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if MASTER == 2:  # join: the weight's bits shifted up plus the sign-extended remainder (remainder.join_into)
            hi = tl.load(w_ptr + offs, mask=mask).to(tl.int16, bitcast=True).to(tl.int32)
            p = ((hi << 16) + tl.load(rem_ptr + offs, mask=mask).to(tl.int32)).to(tl.float32, bitcast=True)
        elif MASTER == 1:
            p = tl.load(master_ptr + offs, mask=mask)
        else:
            p = tl.load(w_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) * inv_scale * coef  # the fp32 part's two multiplies
        m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
        lr, b1, b2, eps = tl.load(s_ptr), tl.load(s_ptr + 1), tl.load(s_ptr + 2), tl.load(s_ptr + 3)
        wd, bc1, bc2_sqrt = tl.load(s_ptr + 4), tl.load(s_ptr + 5), tl.load(s_ptr + 6)
        if DOUBLE:
            pd, gd = p.to(tl.float64), g.to(tl.float64)
            if DECAY:
                if WD_FMA:
                    p = tl.fma(-(lr * wd), pd, pd).to(tl.float32)
                else:
                    p = (pd - lr * wd * pd).to(tl.float32)
            m = tl.fma(b1, m.to(tl.float64), (1.0 - b1) * gd).to(tl.float32)
            v = tl.fma(b2, v.to(tl.float64), (1.0 - b2) * gd * gd).to(tl.float32)
            step_size = (lr / bc1).to(tl.float32)  # bc1, bc2_sqrt: fp32 values (the kernel's opmath_t arguments)
            denom = (tl.math.div_rn(tl.math.sqrt_rn(v), bc2_sqrt.to(tl.float32)).to(tl.float64) + eps).to(tl.float32)
        else:
            if DECAY:
                if WD_FMA:
                    p = tl.fma(-(lr * wd), p, p)
                else:
                    p = p - lr * wd * p
            m = tl.fma(b1, m, tl.fma(-b1, g, g))
            gg = g * g
            v = tl.fma(b2, v, tl.fma(-b2, gg, gg))
            step_size = tl.math.div_rn(lr, bc1)
            denom = tl.math.div_rn(tl.math.sqrt_rn(v), bc2_sqrt) + eps
        p = p - tl.math.div_rn(step_size * m, denom)
        _store_rounded(m_ptr + offs, m, mask)
        _store_rounded(v_ptr + offs, v, mask)
        if MASTER == 2:  # split: low half the remainder, high half rounded to nearest, ties away (split_from)
            bits = p.to(tl.int32, bitcast=True)
            tl.store(rem_ptr + offs, bits.to(tl.int16), mask=mask)
            tl.store(w_ptr + offs, ((bits + 0x8000) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        elif MASTER == 1:
            tl.store(master_ptr + offs, p, mask=mask)
            _store_rounded(w_ptr + offs, p, mask)  # the half weight, as torch's copy_ rounds it
        else:
            tl.store(w_ptr + offs, p, mask=mask)


def scalars(h: Hyper, step: int, math: Math, device: torch.device) -> torch.Tensor:
    """The kernel's scalars for hyperparameters h at optimizer step `step` (1 at the first): lr, beta1, beta2, eps,
    weight_decay, bc1, sqrt(bc2), in the fused kernel's precision; the bias corrections by torch.pow on the device
    from a float32 step count, as torch's kernel computes them. Filled on the device: no host sync."""
    dtype = torch.float64 if math.double else torch.float32
    out = torch.empty(7, dtype=dtype, device=device)
    for i, x in enumerate((h.lr, h.beta1, h.beta2, h.eps, h.weight_decay)):
        out[i].fill_(x)
    out[5], out[6] = bias_corrections(h.beta1, h.beta2, torch.full((), float(step), device=device), math)
    return out


def bias_corrections(beta1: float, beta2: float, steps: torch.Tensor, math: Math) -> tuple[torch.Tensor, torch.Tensor]:
    """(1 - beta1**step, sqrt(1 - beta2**step)) for float32 step counts `steps` (any shape, on the device), as torch's
    fused kernel computes them: torch.pow in its precision, rounded to fp32."""
    count = steps.to(torch.float64 if math.double else torch.float32)
    return (1 - torch.pow(beta1, count)).float(), torch.sqrt(1 - torch.pow(beta2, count)).float()


PROBE_HYPER = Hyper(3e-2, 0.9, 0.95, 1e-8, 0.5, 0.0)  # a large decay: the contracted and plain forms differ often
PROBE_STEPS = (8, 9)  # optimizer steps of the probe, from stored moments


def probe_case(device: torch.device, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A probe of torch's fused AdamW on `device`: (start, want), each [weight, grad, exp_avg, exp_avg_sq] of n fp32
    elements on `device`, want after PROBE_STEPS of PROBE_HYPER (fp32 weights, decayed)."""
    gen = torch.Generator(device=device).manual_seed(0)
    start = [torch.randn(n, generator=gen, device=device) * s for s in (1.0, 1e-2, 1e-3)]
    start.append(torch.rand(n, generator=gen, device=device) * 1e-5)
    h = PROBE_HYPER
    want = [t.clone() for t in start]
    for step in PROBE_STEPS:  # the fused step counts up before it uses the count
        count = [torch.full((), float(step - 1), device=device)]
        adamw([want[0]], [want[1]], [want[2]], [want[3]], [], count, foreach=False, fused=True, amsgrad=False,
              beta1=h.beta1, beta2=h.beta2, lr=h.lr, weight_decay=h.weight_decay, eps=h.eps,
              maximize=False)  # fmt: skip
    return start, want


def launch(*, weight: torch.Tensor, master: torch.Tensor | None, rem: torch.Tensor | None, grad: torch.Tensor,
           m: torch.Tensor, v: torch.Tensor, scalars_: torch.Tensor, decay: bool, inv_scale: float, coef: float,
           math: Math) -> None:  # fmt: skip
    """One parameter's step in place (flat contiguous tensors of one length): weight with `rem` (remainder form),
    with an fp32 `master` (half weights), or alone (fp32 weights, their own masters)."""
    form = REMAINDER if rem is not None else HALF_MASTER if master is not None else FP32_MASTER
    n = weight.numel()
    _adamw_pass[(triton.cdiv(n, BLOCK),)](
        weight, master if master is not None else weight, rem if rem is not None else weight, grad, m, v, scalars_,
        n, float(inv_scale), float(coef), MASTER=form, DOUBLE=math.double, WD_FMA=math.wd_fma, DECAY=decay,
        BLOCK=BLOCK, num_warps=8, enable_fp_fusion=False)  # fmt: skip


@functools.cache
def device_math(device: torch.device) -> Math | None:
    """The candidate arithmetic that reproduces torch's fused AdamW on `device` bit for bit on a probe (fp32
    weights, two decayed steps from stored moments), or None: no Triton, not CUDA, the kernel fails to build, or
    none matches (each of the last two said in one warning line)."""
    if triton is None or device.type != "cuda":
        return None
    start, want = probe_case(device, 1 << 20)
    try:  # the fast path is optional: a kernel that does not build here leaves the staged step, with one line
        for math in CANDIDATES:
            got = [t.clone() for t in start]
            for step in PROBE_STEPS:
                launch(weight=got[0], master=None, rem=None, grad=start[1], m=got[2], v=got[3], decay=True,
                       scalars_=scalars(PROBE_HYPER, step, math, device), inv_scale=1.0, coef=1.0,
                       math=math)  # fmt: skip
            if all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, want, strict=True)):
                return math
    except Exception as e:  # noqa: BLE001  (Triton's compile and launch errors have no common base)
        said = (str(e).splitlines() or [type(e).__name__])[0]
        _log.warning("the one-pass narrow-state kernel did not run on %s (%s); the narrow-state GPU step keeps the "
                     "staged path (widen, fused AdamW, round back)", device, said)  # fmt: skip
        return None
    _log.warning("torch's fused AdamW on %s computes none of the known arithmetics; the narrow-state GPU step "
                 "keeps the staged path (widen, fused AdamW, round back)", device)  # fmt: skip
    return None
