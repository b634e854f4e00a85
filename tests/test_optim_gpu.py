"""HybridDeviceOptimizer on CUDA: parity with torch's AdamW, bf16 masters, and GPU memory falling with f."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from optim_reference import (
    HP,
    batches,
    groups,
    max_rel_err,
    run_hybrid,
    run_reference,
    slow_cpu_threads,
    tiny_gpt,
)

from engine.models.gpt import GPT, gpt_loss
from engine.optim import HybridDeviceOptimizer, HybridOptions, fused_kernel
from engine.optim.adam_math import Hyper, adamw_scalars, adamw_torch_

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA"),
]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
def test_cuda_adamw_parity_20_steps(fraction, overlap):
    model, data = tiny_gpt(device="cuda"), batches(20, micro=2, device="cuda")
    ref = run_reference(model, data, max_norm=0.5)
    ours, opt = run_hybrid(copy.deepcopy(model), data, max_norm=0.5, offload_fraction=fraction,
                           overlap_cpu_optimizer_d2h_h2d=overlap)  # fmt: skip
    if fraction > 0:
        assert opt.cpu.cuda and opt.cpu.master.flat.device.type == "cpu"
    assert max_rel_err(ours, ref) <= 1e-6


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_cuda_bf16_masters(fraction):
    """bf16 weights: the fp32 masters follow torch's fp32 AdamW fed the very gradients ours received.

    The gradients are captured from our model (a hook registered before the optimizer's) rather than
    recomputed on a twin model, since CUDA's bf16 embedding backward accumulates in a nondeterministic order."""
    model = tiny_gpt(device="cuda", dtype=torch.bfloat16)
    data = batches(5, micro=2, device="cuda")
    captured: dict[str, torch.Tensor] = {}

    def capture(name):
        def hook(p):
            acc = captured.get(name)
            captured[name] = p.grad.float() if acc is None else acc + p.grad.float()

        return hook

    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(capture(n))
    opt = HybridDeviceOptimizer(groups(model, 0.1, named=True), HybridOptions(**HP, offload_fraction=fraction,
                                overlap_cpu_optimizer_d2h_h2d=True))  # fmt: skip
    opt.attach_model(model)
    names = [n for n, _ in model.named_parameters()]
    masters = {n: p.detach().float().clone().requires_grad_() for n, p in model.named_parameters()}
    ref_opt = torch.optim.AdamW(
        [{"params": [m for m in masters.values() if m.dim() >= 2], "weight_decay": 0.1},
         {"params": [m for m in masters.values() if m.dim() < 2], "weight_decay": 0.0, "lr": 2e-3}], **HP
    )  # fmt: skip
    for micro in data:
        opt.zero_grad()
        captured.clear()
        for i, tokens in enumerate(micro):
            opt.set_grad_final(i == len(micro) - 1)
            gpt_loss(model(tokens), tokens).backward()
        opt.clip_and_step(0.0)
        for n in names:
            masters[n].grad = captured[n]
        ref_opt.step()
        sd = opt.state_dict()["state"]
        for n in names:
            m = masters[n].detach()
            err = (sd[n]["master"].cuda() - m).abs().max() / max(m.abs().max(), 1e-2)
            assert err <= 1e-6, (fraction, n, err.item())
        for n, p in model.named_parameters():
            assert torch.equal(p, sd[n]["master"].cuda().to(torch.bfloat16)), n  # weights are the masters rounded


def test_peak_gpu_memory_falls_with_fraction():
    peaks = []
    for fraction in (0.0, 0.5, 1.0):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = GPT(num_layers=4, hidden_size=1024, num_attention_heads=8, seq_length=128, vocab_size=256)
        model = model.to(torch.bfloat16)
        opt = HybridDeviceOptimizer(model.named_parameters(), HybridOptions(lr=1e-4, offload_fraction=fraction,
                                    overlap_cpu_optimizer_d2h_h2d=True))  # fmt: skip
        opt.attach_model(model)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        tokens = torch.randint(0, 256, (2, 128), device="cuda")
        for _ in range(2):
            opt.zero_grad()
            gpt_loss(model(tokens), tokens).backward()
            opt.clip_and_step(1.0)
        opt.synchronize()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
        opt.close()
        del model, opt
        torch.cuda.empty_cache()
    assert peaks[0] > peaks[1] > peaks[2], peaks


@pytest.mark.parametrize("max_norm", [0.5, 0.0])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_cuda_gpu_assist_parity(fraction, max_norm, monkeypatch):
    """The GPU assist (host states staged through the GPU's fused AdamW) next to the CPU threads:
    clipped and unclipped (speculation committed), to 1e-6 of torch's AdamW; staging is 3 slots."""
    assisted: list[int] = []
    slow_cpu_threads(monkeypatch, assisted)
    model, data = tiny_gpt(device="cuda"), batches(20, micro=2, device="cuda")
    ref = run_reference(model, data, max_norm=max_norm)
    ours, opt = run_hybrid(copy.deepcopy(model), data, max_norm=max_norm, offload_fraction=fraction,
                           overlap_cpu_optimizer_d2h_h2d=True, gpu_assist=True)  # fmt: skip
    assert opt.cpu.assist is not None and opt.cpu.master.flat.is_pinned() and opt.cpu.m.flat.is_pinned()
    assert len(assisted) > 0
    largest = max(p.numel() for n, p in ours.named_parameters() if n in opt.cpu_names)
    assert opt.cpu.assist.staging_bytes() <= 3 * (16 + 4) * largest  # fp32 master, m, v, grad; grad as shipped
    assert max_rel_err(ours, ref) <= 1e-6


@pytest.mark.parametrize("beta1", [0.9, 0.3])  # lerp from either end
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_cuda_torch_ops_round_like_the_cpu_pass(beta1, grad_dtype):
    """torch's single-tensor AdamW ops on CUDA (the assist's arithmetic) against fused_adamw.c on the host: bit
    for bit, so a unit's update does not depend on which worker steps it. (Whole runs are not compared bit for
    bit on CUDA: runs with and without the assist differed on the H200 though each step agrees; the
    attention backward's nondeterminism most likely, not isolated.)"""
    if fused_kernel.load() is None:
        pytest.skip("no C compiler: the CPU pass is torch's ops itself")
    g = torch.Generator().manual_seed(0)
    n = 1 << 20
    p, m = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
    v, grad = torch.rand(n, generator=g) * 1e-4, (torch.randn(n, generator=g) * 1e-2).to(grad_dtype)
    s = adamw_scalars(Hyper(3e-4, beta1, 0.95, 1e-8, 0.1, 0.0), 7, 0.5, 0.8)
    cpu = [t.clone() for t in (p, m, v)]
    half = torch.empty(n, dtype=torch.bfloat16)
    fused_kernel.adamw_slice(fused_kernel.load(), 0, n, *cpu, grad, None, *cpu, half, s)
    gpu = [t.cuda() for t in (p, m, v)]
    adamw_torch_(*gpu, grad.cuda(), None, s)
    for a, b in zip(gpu, cpu, strict=True):
        assert torch.equal(a.cpu(), b)
    assert torch.equal(gpu[0].to(torch.bfloat16).cpu(), half)


def test_gpu_wait_covers_a_slow_cpu_step(monkeypatch):
    """The GPU's waits at CPU-stepped units (CUDA events around each forward pre-hook's wait) measure a CPU step
    slowed on purpose: the tiny model's GPU work is a few ms, so the GPU stands still for most of the sleep."""
    from engine.optim import cpu_arith, cpu_side

    sleep_s = 0.05
    step_fused, settle = cpu_arith.FusedAdamW.step, cpu_side.CpuPart._settle_waits
    waits: list[float] = []

    def slow(self, *a, **kw):
        time.sleep(sleep_s)
        return step_fused(self, *a, **kw)

    def spy(self):
        settle(self)
        waits.append(self.timing["gpu_wait_s"])

    monkeypatch.setattr(cpu_arith.FusedAdamW, "step", slow)
    monkeypatch.setattr(cpu_side.CpuPart, "_settle_waits", spy)
    model = tiny_gpt(device="cuda")
    _, opt = run_hybrid(model, batches(4, micro=1, device="cuda"), max_norm=0.0, offload_fraction=1.0,
                        overlap_cpu_optimizer_d2h_h2d=True)  # fmt: skip
    units = len(opt.cpu.units)
    assert len(waits) == 4 and waits[0] == 0.0  # the first launch has no earlier update to have waited for
    for w in waits[1:]:
        assert 0.5 * units * sleep_s <= w <= 3 * units * sleep_s, (w, units)
