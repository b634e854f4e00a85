"""The optimizer interface (engine/optim/protocol.py): every optimizer the engine steps implements EngineOptimizer,
a plain torch optimizer is wrapped once, the one unscale/clip/finite decision, and LR schedulers see the step."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from engine.optim import HybridDeviceOptimizer, HybridOptions
from engine.optim.distributed import DistributedOptimizer
from engine.optim.protocol import EngineOptimizer, TorchOptimizer, as_engine_optimizer, decide, unscale_and_clip_


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def backward(m: nn.Module, scale: float = 1.0) -> None:
    torch.manual_seed(1)
    (m(torch.randn(4, 6)).square().sum() * scale).backward()


def hybrid(m: nn.Module) -> HybridDeviceOptimizer:
    return HybridDeviceOptimizer(m.named_parameters(), HybridOptions(lr=0.1, offload_fraction=0.5))


def distributed(m: nn.Module) -> DistributedOptimizer:  # one process: the whole model is this rank's shard
    groups = [{"params": list(m.named_parameters())}]
    return DistributedOptimizer(groups, lambda g: torch.optim.AdamW(g, lr=0.1, weight_decay=0.0))


def megatron_adapter(m: nn.Module) -> EngineOptimizer:
    from engine.megatron.optimizer import MegatronOptimizerAdapter

    return MegatronOptimizerAdapter(torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.0))


def wrapped_torch(m: nn.Module) -> EngineOptimizer:
    return as_engine_optimizer(torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.0))


BUILDERS = {"hybrid": hybrid, "distributed": distributed, "megatron": megatron_adapter, "torch": wrapped_torch}


@pytest.mark.parametrize("kind", BUILDERS)
def test_every_engine_optimizer_implements_the_interface(kind):
    opt = BUILDERS[kind](model())
    assert isinstance(opt, EngineOptimizer)
    assert as_engine_optimizer(opt) is opt  # never wrapped twice
    assert opt.host_bytes() >= 0 and (opt.comm_hook() is None) == (kind != "distributed")


def test_a_plain_torch_optimizer_is_wrapped_and_shares_its_groups():
    sgd = torch.optim.SGD(model().parameters(), lr=0.1)
    assert not isinstance(sgd, EngineOptimizer)
    opt = as_engine_optimizer(sgd)
    assert isinstance(opt, TorchOptimizer) and opt.inner is sgd and opt.param_groups is sgd.param_groups


@pytest.mark.parametrize("kind", BUILDERS)
def test_an_lr_scheduler_on_the_optimizer_sees_clip_and_step(kind):
    """torch warns "lr_scheduler.step() before optimizer.step()" unless the update went through the step it wraps."""
    m = model()
    opt = BUILDERS[kind](m)
    on = opt.inner if kind == "torch" else opt  # a user's scheduler is built on the user's own optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(on, lambda s: 0.5**s)
    backward(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opt.clip_and_step(1.0)[1]
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.05


@pytest.mark.parametrize("kind", BUILDERS)
def test_finite_false_skips_the_step_and_reports_the_real_norm(kind):
    m = model()
    opt = BUILDERS[kind](m)
    before = copy.deepcopy(m.state_dict())
    backward(m, scale=4.0)
    expected = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]) / 4.0
    norm, stepped = opt.clip_and_step(1.0, grad_scale=4.0, finite=torch.tensor(False))
    opt.synchronize()
    assert not stepped and norm == pytest.approx(float(expected), rel=1e-6)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


@pytest.mark.parametrize("kind", BUILDERS)
def test_unscaled_clipped_step_equals_torch_adamw_after_clip_grad_norm(kind):
    """Element-wise against torch: unscale by 8, clip to 0.5 with clip_grad_norm_, AdamW's step."""
    m, ref = model(), model()
    opt = BUILDERS[kind](m)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.0)
    for _ in range(2):
        backward(m, scale=8.0)
        backward(ref)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        norm, stepped = opt.clip_and_step(0.5, grad_scale=8.0)
        assert stepped and norm == pytest.approx(float(ref_norm), rel=1e-6)
        opt.zero_grad()
        ref_opt.zero_grad()
    opt.synchronize()
    for (n, a), b in zip(m.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=n)


def test_the_one_decision():
    norm = torch.tensor(3.0)
    assert decide(norm, 0.0) == (3.0, 1.0, True)  # no clipping
    d = decide(norm, 1.5)
    assert d.ok and d.norm == 3.0 and d.coef == pytest.approx(1.5 / (3.0 + 1e-6))
    assert decide(norm, 1.5, finite=torch.tensor(False)).ok is False
    assert decide(norm, 1.5, finite=torch.tensor(True)).ok is True
    assert not decide(torch.tensor(math.inf), 1.0).ok and not decide(torch.tensor(math.nan), 0.0).ok


def test_unscale_and_clip_is_clip_grad_norm_bit_for_bit():
    a, b = model(), model()
    backward(a, scale=1024.0)
    backward(b, scale=1024.0)
    torch._foreach_mul_([p.grad for p in b.parameters()], 1.0 / 1024.0)
    ref = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.3, foreach=True)
    d = unscale_and_clip_(a.parameters(), 0.3, grad_scale=1024.0)
    assert d.ok and d.norm == float(ref)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("dtype,micro,fp32_sums,per_param", [
    (torch.float32, 1, True, (8, 8)),        # fp32 weights are the masters: states only off the GPU; grad + weight
    (torch.bfloat16, 2, True, (12, 6)),      # + the fp32 master; the fp32 gradient sum comes down, bf16 goes up
    (torch.bfloat16, 2, False, (12, 4)),     # bf16 accumulation: bf16 both ways
    (torch.bfloat16, 1, True, (12, 4)),      # one micro-batch: no fp32 sums
])  # fmt: skip
def test_cpu_offload_counts_what_moves(dtype, micro, fp32_sums, per_param):
    """The summary's figures (EngineOptimizer.cpu_offload), by parameter, against the bytes each part holds."""
    m = model().to(dtype)
    opt = HybridDeviceOptimizer(
        m.named_parameters(), HybridOptions(lr=0.1, offload_fraction=1.0, accumulate_grads_in_fp32=fp32_sums)
    )
    n = sum(p.numel() for p in m.parameters())
    assert opt.cpu_offload(micro) == (n, n, per_param[0] * n, per_param[1] * n)
    none = HybridDeviceOptimizer(m.named_parameters(), HybridOptions(lr=0.1, offload_fraction=0.0))
    assert none.cpu_offload(micro) is None and as_engine_optimizer(torch.optim.SGD(m.parameters(), lr=0.1)).cpu_offload(
        micro) is None  # fmt: skip
