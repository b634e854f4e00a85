"""The C pass in the GPU's fused AdamW arithmetic (engine/optim/device_arith.py): each candidate arithmetic bit for
bit against a transcription of it element by element (IEEE fp32 and double operations, fused multiply-adds exact
by rational arithmetic, rounded once); the CPU side uses it only where the parameters are on CUDA; on CUDA, the
C pass gives torch's fused AdamW's bits and a run offloaded at any fraction equals the run without offload."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from engine.optim import device_arith, fused_kernel
from engine.optim.adam_math import Hyper
from engine.optim.narrow_kernel import DOUBLE, FLOAT, FLOAT_UNFUSED

lib = fused_kernel.load()
needs_lib = pytest.mark.skipif(lib is None, reason="the C pass did not build here")
f32 = np.float32


def round_f32(x: Fraction) -> np.float32:
    """x rounded once to the nearest fp32, ties to even (normal range)."""
    if x == 0:
        return f32(0.0)
    sign, x = (-1 if x < 0 else 1), abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    while x >= Fraction(2) ** (e + 1):
        e += 1
    while x < Fraction(2) ** e:
        e -= 1
    scaled = x / Fraction(2) ** (e - 23)  # in [2^23, 2^24)
    q, r = divmod(scaled.numerator, scaled.denominator)
    if 2 * r > scaled.denominator or (2 * r == scaled.denominator and q % 2):
        q += 1
    return f32(sign * float(Fraction(q) * Fraction(2) ** (e - 23)))


def fmaf(a, b, c) -> np.float32:
    return round_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def fma(a: float, b: float, c: float) -> float:
    return float(Fraction(a) * Fraction(b) + Fraction(c))  # float() of a Fraction rounds once, to nearest even


def reference(math, p, m, v, g, lr, b1, b2, eps, wd, bc1, bc2s, inv_scale, coef):
    """One element of torch's fused AdamW in `math`, as narrow_kernel.py's kernel writes it."""
    g = f32(f32(g) * f32(inv_scale)) * f32(coef)
    if math is DOUBLE:
        pd, gd = float(p), float(g)
        if wd != 0:
            p = f32(fma(-(lr * wd), pd, pd))
        m = f32(fma(b1, float(m), (1.0 - b1) * gd))
        v = f32(fma(b2, float(v), (1.0 - b2) * gd * gd))
        step_size = f32(lr / float(bc1))
        denom = f32(float(np.sqrt(v) / f32(bc2s)) + eps)
    else:
        flr, fb1, fb2, fwd = f32(lr), f32(b1), f32(b2), f32(wd)
        if wd != 0:
            p = fmaf(-(flr * fwd), p, p) if math is FLOAT else p - (flr * fwd) * p
        m = fmaf(fb1, m, fmaf(-fb1, g, g))
        gg = g * g
        v = fmaf(fb2, v, fmaf(-fb2, gg, gg))
        step_size = flr / f32(bc1)
        denom = np.sqrt(v) / f32(bc2s) + f32(eps)
    return p - (step_size * m) / denom, m, v


@needs_lib
@pytest.mark.parametrize("math", [FLOAT, FLOAT_UNFUSED, DOUBLE], ids=["float", "float-unfused", "double"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_each_arithmetic_equals_its_transcription_bit_for_bit(math, wd):
    n = 2 * 1024 + 2048 + 37  # the streamed body and both plain ends
    gen = torch.Generator().manual_seed(1)
    p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    v, g = torch.rand(n, generator=gen) * 1e-4, torch.randn(n, generator=gen).to(torch.bfloat16)
    v[::3] *= 1e-10  # sqrt(v) near eps, where adding eps in double or in fp32 differs
    g[1::3] *= 1e-5
    lr, b1, b2, eps, bc1, bc2s, inv_scale, coef = 3e-4, 0.9, 0.95, 1e-8, 0.271, 0.3122, 0.5, 0.8125
    outs = [torch.empty(n) for _ in range(3)]
    half = torch.empty(n, dtype=torch.bfloat16)
    s = (inv_scale, coef, device_arith.CODE[math], lr, b1, b2, eps, wd, bc1, bc2s)
    fused_kernel.adamw_slice(lib, 0, n, p, m, v, g, None, *outs, half, None, device=s)
    idx = range(n)
    pn, mn, vn, gn = (t.float().numpy() for t in (p, m, v, g))
    for i in idx:
        want = reference(math, pn[i], mn[i], vn[i], gn[i], lr, b1, b2, eps, wd, bc1, bc2s, inv_scale, coef)
        got = tuple(o[i].item() for o in outs)
        assert [f32(x).view(np.int32) for x in got] == [f32(x).view(np.int32) for x in want], (i, got, want)
    assert torch.equal(half, outs[0].to(torch.bfloat16))  # the half weights rounded to nearest even
    single = [torch.empty(n) for _ in range(3)]
    from engine.optim.adam_math import adamw_scalars

    hyper = Hyper(lr, b1, b2, eps, wd, 0.0)
    fused_kernel.adamw_slice(lib, 0, n, p, m, v, g, None, *single, None, adamw_scalars(hyper, 3, inv_scale, coef))
    assert not torch.equal(single[0], outs[0])  # a different arithmetic: the test can tell them apart


@needs_lib
@pytest.mark.parametrize("form", ["bf16-moments", "fp16-moments", "remainder", "int8-moments"])
def test_the_narrow_passes_step_in_the_fused_arithmetic_as_the_fp32_pass_does(form):
    """The narrow forms in the fused arithmetic: the fp32 device pass on the same values widened, each state then
    stored in its form (moments rounded to nearest even; the remainder form's master bit-equal, rebuilt from weight +
    remainder; 8-bit codes requantised from the same fp32 moments)."""
    from engine.optim import blockwise, remainder
    from engine.optim.cpu_arith import TensorStep

    gen = torch.Generator().manual_seed(4)
    n = 3 * blockwise.BLOCK + 17
    master, g = torch.randn(n, generator=gen) * 0.02, (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    m, v = torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-6
    dev = (1.0, 0.75, device_arith.CODE[FLOAT], 1e-3, 0.9, 0.95, 1e-8, 0.1, 0.271, 0.3122)
    single = adamw_scalars_for_test()
    if form == "remainder":
        w, rem = remainder.split(master)
        m_, v_ = m.clone(), v.clone()
        fused_kernel.narrow_slice(lib, 0, n, TensorStep(w, m_, v_, g, w, m_, v_, None, single, rem, rem, device=dev))
        fused_kernel.adamw_slice(lib, 0, n, master, m, v, g, None, master, m, v, None, None, device=dev)
        assert torch.equal(remainder.join(w, rem).view(torch.int32), master.view(torch.int32))
        assert torch.equal(m_, m) and torch.equal(v_, v)
        return
    if form == "int8-moments":
        mc, ms = blockwise.quantise(m, signed=True)
        vc, vs = blockwise.quantise(v, signed=False)
        p = master.clone()
        wide = [master.clone(), blockwise.dequantise(mc, ms, signed=True), blockwise.dequantise(vc, vs, signed=False)]
        step = TensorStep(p, mc, vc, g, p, mc, vc, None, single, ms=ms, vs=vs, ms_out=ms, vs_out=vs, device=dev)
        fused_kernel.narrow_slice(lib, 0, n, step)
        fused_kernel.adamw_slice(lib, 0, n, *wide, g, None, *wide, None, None, device=dev)
        assert torch.equal(p, wide[0])
        assert torch.equal(mc, blockwise.quantise(wide[1], signed=True)[0])
        return
    dtype = torch.bfloat16 if form == "bf16-moments" else torch.float16
    p, mn, vn = master.clone(), m.to(dtype), v.to(dtype)
    wide = [master.clone(), mn.float(), vn.float()]
    fused_kernel.narrow_slice(lib, 0, n, TensorStep(p, mn, vn, g, p, mn, vn, None, single, device=dev))
    fused_kernel.adamw_slice(lib, 0, n, *wide, g, None, *wide, None, None, device=dev)
    assert torch.equal(p, wide[0])
    assert torch.equal(mn, wide[1].to(dtype)) and torch.equal(vn, wide[2].to(dtype))


def adamw_scalars_for_test() -> tuple[float, ...]:
    from engine.optim.adam_math import adamw_scalars

    return adamw_scalars(Hyper(1e-3, 0.9, 0.95, 1e-8, 0.1, 0.0), 3, 1.0, 0.75)


def test_the_cpu_side_takes_it_only_for_cuda_parameters():
    assert device_arith.find(torch.device("cpu")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA")
def test_on_cuda_the_c_pass_matches_torchs_fused_adamw_and_offload_changes_no_bit():
    from engine.optim import HybridDeviceOptimizer, HybridOptions

    assert device_arith.find(torch.device("cuda")) is not None  # the probe found the device's arithmetic

    def run(fraction: float) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
        model = model.cuda().to(torch.bfloat16)
        groups = [{"params": list(model.named_parameters()), "weight_decay": 0.1}]
        opt = HybridDeviceOptimizer(groups, HybridOptions(lr=1e-3, offload_fraction=fraction))
        for step in range(20):
            x = torch.randn(32, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            model(x.to(torch.bfloat16)).float().pow(2).mean().backward()
            opt.clip_and_step(1.0)
            opt.zero_grad()
        opt.synchronize()
        return [p.detach().clone() for p in model.parameters()]

    base = run(0.0)
    for fraction in (0.5, 1.0):
        assert all(torch.equal(a, b) for a, b in zip(base, run(fraction), strict=True)), fraction
