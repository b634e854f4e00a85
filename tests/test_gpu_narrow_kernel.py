"""The one-pass narrow-state GPU step (engine/optim/narrow_kernel.py). On CPU, where Triton is installed, the kernel
runs in Triton's interpreter against a torch-op transcription of the same arithmetic (both with the interpreter's
FMA, a multiply and an add each rounded: the hardware FMA rounds once, which only CUDA shows), bit for bit, through
NarrowGpuPart (groups, step counts, every master form and moment dtype). On CUDA: torch's fused AdamW arithmetic is
found on the device, and the one-pass step equals the staged one (torch's fused AdamW on widened slices) bit for
bit in every form; tests/test_gpu_states.py's CUDA cases run the one-pass step against the fp32 GPU part."""

from __future__ import annotations

import pytest
import torch

from engine.optim import narrow_kernel, remainder
from engine.optim.adam_math import Hyper
from engine.optim.gpu_narrow import NarrowGpuPart
from engine.optim.narrow_kernel import DOUBLE, FLOAT, FLOAT_UNFUSED, Math

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA")
HYPERS = [Hyper(1e-2, 0.9, 0.95, 1e-8, 0.1, 0.0), Hyper(2e-3, 0.8, 0.99, 1e-6, 0.0, 0.0)]
FORMS = [  # (weight dtype, exp_avg dtype, exp_avg_sq dtype, remainder)
    (BF16, BF16, BF16, True), (BF16, FP32, FP16, True), (BF16, BF16, FP16, False), (FP32, BF16, BF16, False),
    (FP16, BF16, BF16, False), (BF16, FP32, FP32, True)]  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _entries(device: str, dtype: torch.dtype, seed: int = 0) -> list[tuple[str, torch.nn.Parameter, int]]:
    """Three parameters in two groups (the second without decay); sizes not multiples of the kernel's block."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": ((5000,), 0), "b": ((40, 50), 0), "c": ((700,), 1)}
    return [(n, torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)), gi)
            for n, (s, gi) in shapes.items()]  # fmt: skip


def _grads(entries, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {n: (torch.randn(p.shape, generator=gen) * 10).bfloat16().to(p.device) for n, p, _ in entries}


def _reference(st: dict, g: torch.Tensor, h: Hyper, step: int, math: Math, factors: tuple[float, float]) -> None:
    """One parameter's step in torch ops, op for op the kernel's (fma: a multiply and an add, as the interpreter):
    st holds the fp32 master "p", moments "m"/"v" in their dtypes; updated in place."""
    f32 = torch.float32
    calc = torch.float64 if math.double else f32
    lr, b1, b2, eps, wd = (torch.tensor(x, dtype=calc) for x in (h.lr, h.beta1, h.beta2, h.eps, h.weight_decay))
    count = torch.tensor(float(step), dtype=f32).to(calc)
    bc1 = (1 - torch.pow(b1, count)).float()
    bc2_sqrt = torch.sqrt(1 - torch.pow(b2, count)).float()
    g = g.float() * factors[0] * factors[1]
    p, m, v = st["p"], st["m"].float(), st["v"].float()
    fma = lambda a, b, c: a * b + c  # noqa: E731
    sqrt = lambda x: x.double().sqrt().float()  # noqa: E731  correctly rounded (torch's CPU fp32 sqrt is not always)
    if math.double:
        pd, gd = p.double(), g.double()
        if h.weight_decay:
            p = (fma(-(lr * wd), pd, pd) if math.wd_fma else pd - lr * wd * pd).float()
        m = fma(b1, m.double(), (1 - b1) * gd).float()
        v = fma(b2, v.double(), (1 - b2) * gd * gd).float()
        step_size = (lr / bc1.double()).float()
        denom = ((sqrt(v) / bc2_sqrt).double() + eps).float()
    else:
        if h.weight_decay:
            p = fma(-(lr * wd), p, p) if math.wd_fma else p - lr * wd * p
        m = fma(b1, m, fma(-b1, g, g))
        v = fma(b2, v, fma(-b2, g * g, g * g))
        step_size = lr / bc1
        denom = sqrt(v) / bc2_sqrt + eps
    st["p"] = p - step_size * m / denom
    st["m"], st["v"] = m.to(st["m"].dtype), v.to(st["v"].dtype)


@pytest.fixture
def interpreted(monkeypatch):
    """The kernel in Triton's interpreter (numpy on the host), where Triton is installed."""
    interpreter = pytest.importorskip("triton.runtime.interpreter", reason="Triton is not installed")
    monkeypatch.setattr(narrow_kernel, "_adamw_pass", interpreter.InterpretedFunction(narrow_kernel._adamw_pass.fn))
    monkeypatch.setattr(narrow_kernel, "_store_rounded", narrow_kernel._store_rounded.fn)  # called from within


@pytest.mark.parametrize("math", [FLOAT, FLOAT_UNFUSED, DOUBLE])
@pytest.mark.parametrize(("w_dtype", "m_dtype", "v_dtype", "rem"), FORMS)
def test_one_pass_against_its_torch_transcription(interpreted, math, w_dtype, m_dtype, v_dtype, rem):
    """Three steps through NarrowGpuPart's one-pass step (loss-scaled and clipped gradients, a parameter left out of
    the second step so the counts differ): masters, moments, weights and counts bit-equal to the transcription."""
    entries = _entries("cpu", w_dtype)
    part = NarrowGpuPart(entries, moment_dtypes=(m_dtype, v_dtype), remainders=rem, math=math)
    gen = torch.Generator().manual_seed(1)
    want = {}
    for n, p, _ in entries:
        st = {"step": 6, "master": p.detach().float() + torch.randn(p.shape, generator=gen) * 1e-3,
              "exp_avg": (torch.randn(p.shape, generator=gen) * 1e-2).to(m_dtype),
              "exp_avg_sq": (torch.rand(p.shape, generator=gen) * 1e-4).to(v_dtype)}  # fmt: skip
        part.load(n, st)
        master = part.export(n)["master"]  # as the form holds it (the weight + remainder, or fp32 weights)
        want[n] = {"p": master.reshape(-1), "m": st["exp_avg"].reshape(-1), "v": st["exp_avg_sq"].reshape(-1), "n": 6}
    for step, factors in enumerate([(1 / 1024, 0.7), (1.0, 1.0), (1 / 3, 0.7)]):  # 1/3, 0.7: the two multiplies show
        grads = {n: g for n, g in _grads(entries, step).items() if not (step == 1 and n == "b")}
        part.step(grads, HYPERS, *factors)
        for n, g in grads.items():
            want[n]["n"] += 1
            _reference(want[n], g.reshape(-1), HYPERS[part.group_of[n]], want[n]["n"], math, factors)
    for n, p, _ in entries:
        got, ref = part.export(n), want[n]
        assert got["step"] == ref["n"] == (8 if n == "b" else 9), n
        assert torch.equal(_bits(got["master"].reshape(-1)), _bits(ref["p"])), n
        for k, key in (("exp_avg", "m"), ("exp_avg_sq", "v")):
            assert got[k].dtype == ref[key].dtype and torch.equal(_bits(got[k].reshape(-1)), _bits(ref[key])), (n, k)
        weight = remainder.split(ref["p"])[0] if rem else ref["p"].to(w_dtype)
        assert torch.equal(_bits(p.detach().reshape(-1)), _bits(weight)), n


def test_the_staged_step_stays_where_no_kernel_runs():
    """On the host (no CUDA) the part keeps the staged step; the plan's stated bytes are the one pass's."""
    part = NarrowGpuPart(_entries("cpu", BF16), moment_dtypes=(BF16, BF16), remainders=True)
    assert part.math is None and narrow_kernel.device_math(torch.device("cpu")) is None
    assert narrow_kernel.one_pass_bytes(moment_bytes=(2, 2), master=narrow_kernel.REMAINDER, grad_bytes=2) == 18


@pytest.mark.gpu
@CUDA
def test_the_device_arithmetic_is_found_and_used():
    """torch's fused AdamW on this device is one of the transcribed arithmetics, so the narrow part steps in one
    pass (a None here means the staged step runs: slower, still exact)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    math = narrow_kernel.device_math(dev)
    assert math in narrow_kernel.CANDIDATES, f"torch {torch.__version__}: no arithmetic matched"
    part = NarrowGpuPart(_entries("cuda", BF16), moment_dtypes=(BF16, BF16), remainders=True)
    assert part.math == math


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize(("w_dtype", "m_dtype", "v_dtype", "rem"), FORMS)
def test_one_pass_equals_the_staged_step_on_cuda(w_dtype, m_dtype, v_dtype, rem):
    """Four steps, one pass against the staged step (torch's fused AdamW on fp32 slices, rounded back): every
    master, moment and weight bit-equal."""
    runs = []
    for math in ("auto", None):
        entries = _entries("cuda", w_dtype)
        part = NarrowGpuPart(entries, moment_dtypes=(m_dtype, v_dtype), remainders=rem, math=math)
        assert (part.math is None) == (math is None)
        for step, factors in enumerate([(1 / 1024, 0.7), (1.0, 1.0), (1.0, 0.5), (1 / 8, 1.0)]):
            part.step(_grads(entries, step), HYPERS, *factors)
        runs.append(({n: part.export(n) for n, _, _ in entries}, {n: p.detach().cpu() for n, p, _ in entries}))
    (one, w_one), (staged, w_staged) = runs
    for n, st in staged.items():
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(one[n][k]), _bits(st[k])), (n, k)
        assert torch.equal(_bits(w_one[n]), _bits(w_staged[n])), n
