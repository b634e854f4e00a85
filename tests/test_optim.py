"""HybridDeviceOptimizer on CPU: the offload code path with host copies, against plain torch optimizers."""

from __future__ import annotations

import copy
import io
import threading

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

from engine.models.gpt import gpt_loss
from engine.optim import HybridDeviceOptimizer, HybridOptions, fused_kernel
from engine.optim.partition import split_for_offload, unit_of

FRACTIONS = [0.0, 0.25, 0.5, 1.0]
HAVE_KERNEL = fused_kernel.load() is not None


@pytest.fixture(scope="module")
def reference():
    model = tiny_gpt()
    data = batches(20, micro=2)
    return model, data, run_reference(model, data, max_norm=0.5)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_adamw_parity_20_steps(reference, fraction, overlap):
    """Accumulation over 2 micro-batches, clipping (active), weight decay by group, LR schedule."""
    model, data, ref = reference
    ours, opt = run_hybrid(copy.deepcopy(model), data, max_norm=0.5, offload_fraction=fraction,
                           overlap_cpu_optimizer_d2h_h2d=overlap, cpu_threads=2)  # fmt: skip
    if fraction > 0:
        assert opt.cpu is not None and opt.cpu.lib is not None or not HAVE_KERNEL
    assert max_rel_err(ours, ref) <= 1e-6


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_bit_exact_with_torch_kernels(reference, fraction, monkeypatch):
    """Where the same arithmetic runs (torch's ops on both sides), the result is bit for bit torch's."""
    monkeypatch.setattr(fused_kernel, "_lib", None)
    monkeypatch.setattr(fused_kernel, "_tried", True)
    model, data, ref = reference
    ours, _ = run_hybrid(copy.deepcopy(model), data, max_norm=0.5, offload_fraction=fraction,
                         overlap_cpu_optimizer_d2h_h2d=True)  # fmt: skip
    for (n, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_torch_optimizer_for_cpu_part(reference):
    model, data, ref = reference
    ours, opt = run_hybrid(copy.deepcopy(model), data, max_norm=0.5, offload_fraction=0.5,
                           use_torch_optimizer_for_cpu_offload=True)  # fmt: skip
    assert opt.cpu.inner
    assert max_rel_err(ours, ref) <= 1e-6


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_sgd_parity(fraction):
    model, data = tiny_gpt(), batches(8, micro=1)
    ref = run_reference(model, data, max_norm=1.0, sgd=True)
    ours, _ = run_hybrid(copy.deepcopy(model), data, max_norm=1.0, sgd=True, offload_fraction=fraction,
                         overlap_cpu_optimizer_d2h_h2d=True)  # fmt: skip
    assert max_rel_err(ours, ref) <= 1e-6


def test_bf16_weights_fp32_masters():
    """bf16 model weights, fp32 masters and fp32 accumulation: masters follow an fp32 AdamW fed the same grads."""
    model = tiny_gpt(dtype=torch.bfloat16)
    data = batches(6, micro=2)
    for fraction in (0.0, 0.5, 1.0):
        ours = copy.deepcopy(model)
        ref = copy.deepcopy(model)
        opt = HybridDeviceOptimizer(groups(ours, 0.1, named=True), HybridOptions(**HP, offload_fraction=fraction,
                                    overlap_cpu_optimizer_d2h_h2d=True))  # fmt: skip
        opt.attach_model(ours)
        masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
        ref_opt = torch.optim.AdamW(
            [{"params": [m for m in masters if m.dim() >= 2], "weight_decay": 0.1},
             {"params": [m for m in masters if m.dim() < 2], "weight_decay": 0.0, "lr": 2e-3}], **HP
        )  # fmt: skip

        for micro in data:
            opt.zero_grad()
            with torch.no_grad():  # the reference computes its gradients on our weights: the same gradients,
                for r, p in zip(ref.parameters(), ours.parameters(), strict=True):  # so masters differ by
                    r.copy_(p)  # the two AdamW kernels' rounding only, never by a bf16 weight rounded apart
            acc = [torch.zeros_like(m) for m in masters]
            for i, tokens in enumerate(micro):
                opt.set_grad_final(i == len(micro) - 1)
                gpt_loss(ours(tokens), tokens).backward()
                ref.zero_grad()
                gpt_loss(ref(tokens), tokens).backward()
                for a, p in zip(acc, ref.parameters(), strict=True):
                    a.add_(p.grad.float())
            opt.clip_and_step(0.0)
            for m, a in zip(masters, acc, strict=True):
                m.grad = a
            ref_opt.step()
            opt.synchronize()
            for (n, p), m in zip(ours.named_parameters(), masters, strict=True):
                got = opt.state_dict()["state"][n]["master"] if n in opt.cpu_names else opt.gpu.master[n]
                err = (got.float() - m.detach()).abs().max() / m.detach().abs().max()
                assert err <= 1e-6, (fraction, n, err.item())
                assert torch.equal(p, got.reshape(p.shape).to(torch.bfloat16)), n  # the weights: masters rounded


def test_cross_fraction_checkpoint(tmp_path):
    """Saved at f=0.25, loaded at f=0.75 (and 0): continues like the run that never stopped."""
    model, data = tiny_gpt(), batches(10, micro=2)
    straight, _ = run_hybrid(copy.deepcopy(model), data, max_norm=0.5, offload_fraction=0.25,
                             overlap_cpu_optimizer_d2h_h2d=True)  # fmt: skip
    first, opt = run_hybrid(copy.deepcopy(model), data[:5], max_norm=0.5, offload_fraction=0.25,
                            overlap_cpu_optimizer_d2h_h2d=True)  # fmt: skip
    path = tmp_path / "ckpt.pt"
    torch.save({"model": first.state_dict(), "optim": opt.state_dict()}, path)
    for fraction in (0.75, 0.0):
        ckpt = torch.load(path, weights_only=True)
        resumed = tiny_gpt(seed=123)  # different init: everything must come from the checkpoint
        resumed.load_state_dict(ckpt["model"])
        opt2 = HybridDeviceOptimizer(groups(resumed, 0.1, named=True), HybridOptions(**HP, offload_fraction=fraction,
                                     overlap_cpu_optimizer_d2h_h2d=True))  # fmt: skip
        opt2.attach_model(resumed)
        opt2.load_state_dict(ckpt["optim"])
        resumed, _ = run_hybrid(resumed, data[5:], max_norm=0.5, start=5, opt=opt2)
        assert max_rel_err(resumed, straight) <= 1e-6, fraction


def test_state_dict_is_fraction_independent():
    model, data = tiny_gpt(), batches(3, micro=1)
    sds = []
    for fraction in (0.0, 1.0):
        _, opt = run_hybrid(copy.deepcopy(model), data, max_norm=0.0, offload_fraction=fraction)
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        sds.append(opt.state_dict())
    a, b = sds
    assert a["state"].keys() == b["state"].keys() == {n for n, _ in model.named_parameters()}
    for n in a["state"]:
        assert a["state"][n]["step"] == b["state"][n]["step"] == 3
        for k in ("master", "exp_avg", "exp_avg_sq"):
            x, y = a["state"][n][k], b["state"][n][k]
            assert x.device.type == "cpu" and x.dtype == torch.float32 and x.shape == y.shape
            # f=0 steps with torch on the device side, f=1 with the fused CPU pass: equal to rounding
            assert (x - y).abs().max() <= 1e-5 * max(y.abs().max(), 1e-2), (n, k)


@pytest.mark.parametrize("bad", [1.5, -0.1, "0.5", True, float("nan")])
def test_bad_fraction(bad):
    with pytest.raises(
        ValueError, match=r"offload_fraction \(optimizer.optimizer_offload_fraction\)=.* in \[0.0, 1.0\]"
    ):
        HybridDeviceOptimizer(tiny_gpt().named_parameters(), HybridOptions(lr=1e-3, offload_fraction=bad))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(optimizer="adamw"), r"optimizer \(optimizer.optimizer\)='adamw'.*'adam', 'sgd'"),
        (dict(lr=-1.0), r"lr \(optimizer.lr\)=-1.0"),
        (dict(betas=(0.9, 1.5)), r"betas\[1\]=1.5"),
        (dict(cpu_threads=0), r"cpu_threads \(optimizer.cpu_optimizer_threads\)=0"),
        (dict(overlap_cpu_optimizer_d2h_h2d="yes"), r"overlap_cpu_optimizer_d2h_h2d='yes'.*True or False"),
    ],
)
def test_bad_options(kw, match):
    args = dict(lr=1e-3) | kw
    with pytest.raises(ValueError, match=match):
        HybridDeviceOptimizer(tiny_gpt().named_parameters(), HybridOptions(**args))


def test_non_finite_gradients_skip_the_step():
    model = tiny_gpt()
    before = copy.deepcopy(model)
    opt = HybridDeviceOptimizer(
        model.named_parameters(), HybridOptions(lr=1e-3, offload_fraction=0.5, overlap_cpu_optimizer_d2h_h2d=True)
    )
    opt.attach_model(model)
    tokens = batches(1, 1)[0][0]
    (gpt_loss(model(tokens), tokens) * float("inf")).backward()
    norm, stepped = opt.clip_and_step(1.0)
    assert not stepped and not norm < float("inf")
    for a, b in zip(model.parameters(), before.parameters(), strict=True):
        assert torch.equal(a, b)


def test_grad_norm_and_scale():
    """grad_norm is the unscaled pre-clip norm over all parameters; grad_scale divides it out."""
    model = tiny_gpt()
    ref = copy.deepcopy(model)
    tokens = batches(1, 1)[0][0]
    gpt_loss(ref(tokens), tokens).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item()
    opt = HybridDeviceOptimizer(model.named_parameters(), HybridOptions(lr=1e-3, offload_fraction=0.5))
    (gpt_loss(model(tokens), tokens) * 1024.0).backward()
    norm, stepped = opt.clip_and_step(0.0, grad_scale=1024.0)
    assert stepped and norm == pytest.approx(want, rel=1e-6)


def test_split_is_output_side_and_exact_within_one_tensor():
    model = tiny_gpt(layers=4)
    named = list(model.named_parameters())
    total = sum(p.numel() for _, p in named)
    largest = max(p.numel() for _, p in named)
    for f in (0.0, 0.1, 0.25, 0.5, 0.9, 1.0):
        chosen = split_for_offload(named, f)
        n = sum(p.numel() for name, p in named if name in chosen)
        assert abs(n - f * total) <= largest / 2
        flags = [name in chosen for name, _ in named]
        assert flags == sorted(flags), "the CPU part is one run at the output end"
    assert "output.weight" in split_for_offload(named, 0.1)
    assert unit_of("layers.3.attn.qkv.weight") == "layers.3" and unit_of("output.weight") == "output"


def test_state_bytes_follow_fraction():
    """Optimizer state on the 'GPU' side holds (1 - f) of the elements within one tensor; the rest is on the host."""
    model, data = tiny_gpt(dtype=torch.bfloat16), batches(1, 1)
    total = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    for f in (0.0, 0.5, 1.0):
        _, opt = run_hybrid(copy.deepcopy(model), data, max_norm=0.0, offload_fraction=f)
        dev_elems = sum(s["exp_avg"].numel() for s in opt.gpu.opt.state.values()) if opt.gpu.opt else 0
        assert abs(dev_elems - (1 - f) * total) <= largest / 2
        assert (opt.host_bytes() > 0) == (f > 0)


def test_close_removes_hooks():
    model = tiny_gpt()
    opt = HybridDeviceOptimizer(
        model.named_parameters(), HybridOptions(lr=1e-3, offload_fraction=0.5, overlap_cpu_optimizer_d2h_h2d=True)
    )
    opt.attach_model(model)
    opt.close()
    tokens = batches(1, 1)[0][0]
    gpt_loss(model(tokens), tokens).backward()  # no hook fires: the grads stay where autograd put them
    assert all(p.grad is not None for p in model.parameters())


class _NeverGo(threading.Event):
    """Keeps the driver speculating on every queued unit even after the clip factor is known, so the
    test sees every unit go through the speculative path however fast this machine's backward is."""

    def is_set(self) -> bool:
        return False


def _speculating_run(fraction: float, data) -> tuple[torch.nn.Module, HybridDeviceOptimizer]:
    model = tiny_gpt()
    opt = HybridDeviceOptimizer(groups(model, 0.1, named=True), HybridOptions(**HP, offload_fraction=fraction,
                                overlap_cpu_optimizer_d2h_h2d=True))  # fmt: skip
    opt.attach_model(model)
    opt.cpu.go = _NeverGo()
    return run_hybrid(model, data, max_norm=0.0, opt=opt)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_speculative_step_commits_when_unclipped(fraction, monkeypatch):
    """With overlap, units are stepped out of place during backward; unclipped steps commit that result,
    which is bit for bit the in-place step's (same kernel), and with torch's kernel bit for bit torch's."""
    data = batches(6, micro=2)
    ours, opt = _speculating_run(fraction, data)
    assert opt.cpu.speculate and opt.cpu.timing["speculated"] == len(opt.cpu.units)
    plain, _ = run_hybrid(tiny_gpt(), data, max_norm=0.0, offload_fraction=fraction)  # no overlap: no guessing
    for a, b in zip(ours.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    monkeypatch.setattr(fused_kernel, "_lib", None)
    monkeypatch.setattr(fused_kernel, "_tried", True)
    ours, _ = _speculating_run(fraction, data)
    ref = run_reference(tiny_gpt(), data, max_norm=0.0)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_clipped_steps_do_not_commit_a_guess():
    """Always clipped: the first step's guess is thrown away and later steps do not guess."""
    data = batches(4, micro=1)
    clipped, opt = run_hybrid(tiny_gpt(), data, max_norm=1e-3, offload_fraction=0.5, overlap_cpu_optimizer_d2h_h2d=True)
    assert opt.cpu.timing["speculated"] == 0
    assert max_rel_err(clipped, run_reference(tiny_gpt(), data, max_norm=1e-3)) <= 1e-6


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_gpu_assist_parity(reference, fraction, overlap, monkeypatch):
    """Units shared between the CPU threads and the assist (torch's fused AdamW on staged copies):
    the same 20 clipped, accumulated, scheduled steps as torch's AdamW, to 1e-6."""
    assisted: list[int] = []
    slow_cpu_threads(monkeypatch, assisted)
    model, data, ref = reference
    ours, opt = run_hybrid(copy.deepcopy(model), data, max_norm=0.5, offload_fraction=fraction,
                           overlap_cpu_optimizer_d2h_h2d=overlap, cpu_threads=2, gpu_assist=True)  # fmt: skip
    assert len(assisted) > 0 and opt.cpu.assist is not None
    assert max_rel_err(ours, ref) <= 1e-6
    state = opt.state_dict()["state"]  # the host states the assist wrote back are the masters of the model
    for n, p in ours.named_parameters():
        assert torch.equal(state[n]["master"], p.detach()), n


def test_gpu_assist_with_speculation(monkeypatch):
    """Unclipped with overlap: committed guesses from the CPU and assisted units in one step, exact."""
    assisted: list[int] = []
    slow_cpu_threads(monkeypatch, assisted)
    data = batches(6, micro=2)
    ours, opt = run_hybrid(tiny_gpt(), data, max_norm=0.0, offload_fraction=1.0, overlap_cpu_optimizer_d2h_h2d=True,
                           gpu_assist=True)  # fmt: skip
    assert len(assisted) > 0
    assert max_rel_err(ours, run_reference(tiny_gpt(), data, max_norm=0.0)) <= 1e-6


def test_gpu_assist_is_bitwise_the_cpu_threads(reference, monkeypatch):
    """The assist rounds as the CPU threads do: clipped, accumulated steps with units shared between them
    give bit for bit the weights of the CPU threads alone."""
    model, data, _ = reference
    alone, _ = run_hybrid(copy.deepcopy(model), data, max_norm=0.5, offload_fraction=1.0,
                          overlap_cpu_optimizer_d2h_h2d=True, cpu_threads=2)  # fmt: skip
    assisted: list[int] = []
    slow_cpu_threads(monkeypatch, assisted)
    shared, _ = run_hybrid(copy.deepcopy(model), data, max_norm=0.5, offload_fraction=1.0,
                           overlap_cpu_optimizer_d2h_h2d=True, cpu_threads=2, gpu_assist=True)  # fmt: skip
    assert len(assisted) > 0
    for (n, a), (_, b) in zip(shared.named_parameters(), alone.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_gpu_assist_needs_the_engine_adamw():
    with pytest.raises(ValueError, match="gpu_assist=True works with the engine's own AdamW only"):
        HybridDeviceOptimizer(tiny_gpt().named_parameters(), HybridOptions(
                              optimizer="sgd", lr=0.1, offload_fraction=0.5,
                              gpu_assist=True))._build()  # fmt: skip


def test_step_timing_counts_guesses_commits_and_arithmetic():
    """StepTiming of the last step: every unit guessed during backward and, unclipped, committed; the guessing is
    part of the arithmetic; nothing waits on a GPU without CUDA. Clipped, the guesses are made and none is used."""
    _, opt = _speculating_run(0.5, batches(3, micro=2))
    t, n = opt.cpu_step_timing(), len(opt.cpu.units)
    cpu_params = sum(p.numel() for p in opt.cpu.params.values())
    assert t["speculated"] == t["committed"] == n
    assert 0 < t["speculated_s"] <= t["compute_s"] and t["gpu_wait_s"] == 0.0
    assert t["stepped_params"] == cpu_params  # each unit stepped once: its guess
    lib, (m, v), grads = fused_kernel.load(), opt.cpu.host.moment_dtypes, list(opt.cpu.host.grads)
    expected = 0.0 if lib is None else fused_kernel.pass_bytes(m, v, grads[0], opt.cpu.host.half, False)
    assert len(grads) == 1 and t["pass_bytes"] == expected
    model = tiny_gpt()
    opt = HybridDeviceOptimizer(groups(model, 0.1, named=True), HybridOptions(**HP, offload_fraction=0.5,
                                overlap_cpu_optimizer_d2h_h2d=True))  # fmt: skip
    opt.attach_model(model)
    opt.cpu.go = _NeverGo()
    run_hybrid(model, batches(1, micro=1), max_norm=1e-3, opt=opt)
    t = opt.cpu_step_timing()
    assert t["speculated"] == n and t["committed"] == 0
    assert t["stepped_params"] == 2 * cpu_params  # each guess thrown away and the unit stepped again in place
    assert HybridDeviceOptimizer(groups(tiny_gpt(), 0.1, named=True), HybridOptions(**HP)).cpu_step_timing() is None
