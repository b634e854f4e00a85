"""The CPU part's host memory (bounded speculation, weight ring) and its speculative step under a bound.

Host bytes are checked three ways: host_plan's arithmetic, CpuPart.host_bytes(), and an independent walk
over every tensor the CPU part can reach (distinct storages), at several fractions, dtypes and bounds."""

from __future__ import annotations

import collections
import dataclasses
import threading

import pytest
import torch
from optim_reference import HP, batches, groups, run_hybrid

from engine.models.gpt import GPT
from engine.optim import HybridDeviceOptimizer, HybridOptions
from engine.optim.host_plan import cpu_side_host_bytes, speculation_units
from engine.optim.partition import unit_of

MIB = 1 << 20


def gpt(dtype: torch.dtype = torch.float32) -> GPT:
    """Layers of ~198k elements (2.4 MB of fp32 master/m/v each), so MiB bounds fit some of them."""
    torch.manual_seed(0)
    m = GPT(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=16, vocab_size=64)
    return m.to(dtype=dtype)


def walk_host_bytes(part, model: torch.nn.Module) -> int:
    """Bytes of the distinct host storages reachable from the CPU part, the model's own tensors excepted,
    following only the optimizer package's objects and containers (not threads or callbacks)."""
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    own |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    seen_obj, storages = set(), {}
    stack = [part]
    while stack:
        x = stack.pop()
        if id(x) in seen_obj:
            continue
        seen_obj.add(id(x))
        if isinstance(x, torch.Tensor):
            s = x.untyped_storage()
            if x.device.type == "cpu" and x.dim() > 0 and s.data_ptr() not in own and s.nbytes():
                storages[s.data_ptr()] = s.nbytes()  # torch.optim's 0-d step counts are not per-element state
            continue
        if isinstance(x, dict):
            stack += list(x.keys()) + list(x.values())
        elif isinstance(x, (list, tuple, set, frozenset, collections.deque)):
            stack += list(x)
        elif isinstance(x, torch.optim.Optimizer):
            stack += [x.state, x.param_groups]
        elif dataclasses.is_dataclass(x) or type(x).__module__.startswith("engine.optim"):
            stack += list(vars(x).values())
    return sum(storages.values())


def unit_numels(model: torch.nn.Module, cpu_names) -> list[int]:
    out: dict[str, int] = {}
    for n, p in model.named_parameters():
        if n in cpu_names:
            out[unit_of(n)] = out.get(unit_of(n), 0) + p.numel()
    return list(out.values())


CASES = [  # (dtype, micro-batches, fraction, bound MiB, optimizer options)
    (torch.bfloat16, 2, 0.5, 3, {}),
    (torch.bfloat16, 1, 1.0, 6, {}),
    (torch.bfloat16, 2, 0.25, 0, {}),
    (torch.bfloat16, 2, 1.0, 2048, {}),
    (torch.float32, 2, 0.5, 3, {}),
    (torch.float32, 1, 1.0, 1, {}),
    (torch.bfloat16, 2, 0.5, 2048, {"use_torch_optimizer_for_cpu_offload": True}),
    (torch.bfloat16, 2, 0.5, 2048, {"optimizer": "sgd", "momentum": 0.9, "lr": 1e-3}),
    (torch.bfloat16, 1, 1.0, 2048, {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16}),
    (torch.bfloat16, 2, 0.5, 3, {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.float32}),
    (torch.float32, 1, 1.0, 1, {"exp_avg_dtype": torch.float32, "exp_avg_sq_dtype": torch.bfloat16}),
    (torch.bfloat16, 2, 0.5, 2048, {"store_param_remainders": True}),
    (
        torch.bfloat16,
        1,
        1.0,
        3,
        {"store_param_remainders": True, "exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
    ),
]


@pytest.mark.parametrize("dtype,micro,fraction,mb,extra", CASES)
def test_host_bytes_equal_the_plan_and_the_tensors_held(dtype, micro, fraction, mb, extra):
    model = gpt(dtype)
    kw = {**HP, **extra} if "optimizer" not in extra else extra
    opt = HybridDeviceOptimizer(groups(model, 0.1, named=True), HybridOptions(**kw, offload_fraction=fraction,
                                overlap_cpu_optimizer_d2h_h2d=True, speculation_buffer_mb=mb))  # fmt: skip
    opt.attach_model(model)
    run_hybrid(model, batches(2, micro=micro), max_norm=0.0, opt=opt)
    units = unit_numels(model, opt.cpu_names)
    half_bytes = 0 if dtype == torch.float32 else 2
    grad_bytes = 2 if (micro == 1 and dtype != torch.float32) else 4  # fp32 sums over micro-batches
    use_torch = extra.get("use_torch_optimizer_for_cpu_offload", False)
    moments = [extra.get(k, torch.float32).itemsize for k in ("exp_avg_dtype", "exp_avg_sq_dtype")]
    plan = cpu_side_host_bytes(units, kind=extra.get("optimizer", "adam"), use_torch=use_torch, half_bytes=half_bytes,
                               grad_bytes=grad_bytes, speculate=True, speculation_buffer_bytes=mb * MIB,
                               exp_avg_bytes=moments[0], exp_avg_sq_bytes=moments[1],
                               remainders=extra.get("store_param_remainders", False))  # fmt: skip
    walked = walk_host_bytes(opt.cpu, model)
    assert opt.host_bytes() == walked == sum(plan.values()), plan
    n = sum(units)
    bounded = (2 * half_bytes + 4) * max(units) + mb * MIB  # the weight ring, torch.optim's scratch, the spares
    assert walked <= (12 + grad_bytes) * n + bounded
    master = 2 if extra.get("store_param_remainders") else 4
    spares = speculation_units(units, master + sum(moments) + half_bytes, mb * MIB) if plan["speculation"] else []
    assert sorted(opt.cpu.host.spares.sizes()) == sorted(units[i] for i in spares)  # all returned to the pool
    opt.close()


def test_host_bytes_do_not_grow_with_depth_beyond_12_bytes_and_staging():
    """Twice the CPU-stepped layers: master/m/v and gradient staging double, the rest stays put."""
    sizes = {}
    for layers in (2, 4):
        torch.manual_seed(0)
        model = GPT(num_layers=layers, hidden_size=128, num_attention_heads=4, seq_length=16, vocab_size=64)
        model = model.to(torch.bfloat16)
        opt = HybridDeviceOptimizer(groups(model, 0.1, named=True), HybridOptions(**HP, offload_fraction=1.0,
                                    overlap_cpu_optimizer_d2h_h2d=True, speculation_buffer_mb=3))  # fmt: skip
        opt.attach_model(model)
        run_hybrid(model, batches(1, micro=2), max_norm=0.0, opt=opt)
        n = sum(p.numel() for p in model.parameters())
        sizes[layers] = (walk_host_bytes(opt.cpu, model), n)
        opt.close()
    (b2, n2), (b4, n4) = sizes[2], sizes[4]
    assert b4 - b2 == 16 * (n4 - n2)  # 12 B of master/m/v + 4 B of fp32 gradient staging per added element


class _NeverGo(threading.Event):
    """Keeps the driver speculating on every unit however fast backward is (see test_optim)."""

    def is_set(self) -> bool:
        return False


def _run(dtype, mb, data, max_norm=0.0, overlap=True, never_go=True):
    model = gpt(dtype)
    opt = HybridDeviceOptimizer(groups(model, 0.1, named=True), HybridOptions(**HP, offload_fraction=1.0,
                                overlap_cpu_optimizer_d2h_h2d=overlap, speculation_buffer_mb=mb))  # fmt: skip
    opt.attach_model(model)
    if overlap and never_go:
        opt.cpu.go = _NeverGo()
    speculated = []
    for i in range(len(data)):
        run_hybrid(model, data[i : i + 1], max_norm=max_norm, opt=opt, start=i)
        speculated.append(opt.cpu.timing.get("speculated", 0))
    return model, opt, speculated


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_bound_that_fits_some_units_is_bitwise_the_plain_step(dtype):
    """3 MiB holds spares for the output unit and one layer: those are stepped during backward and committed
    (their banks swap with the spares every step), the rest in place; weights and states equal the run
    without speculation bit for bit."""
    data = batches(5, micro=2)
    ours, opt, speculated = _run(dtype, 3, data)
    units = list(opt.cpu.units)
    half_bytes = 0 if dtype == torch.float32 else 2
    expect = len(speculation_units([opt.cpu.layout.numel[u] for u in units], 12 + half_bytes, 3 * MIB))
    assert 0 < expect < len(units) and speculated == [expect] * len(data)
    plain, plain_opt, none = _run(dtype, 3, data, overlap=False)
    assert none == [0] * len(data)
    for (n, a), b in zip(ours.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b), n
    sa, sb = opt.state_dict()["state"], plain_opt.state_dict()["state"]
    for n in sa:
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[n][k], sb[n][k]), (n, k)


def test_clipped_steps_return_their_spares_and_stay_exact():
    """Clipped from the second step on: guesses are thrown away (spares back in the pool), exact in place."""
    data = batches(4, micro=1)
    ours, opt, _ = _run(torch.bfloat16, 3, data, max_norm=0.05)
    plain, _, _ = _run(torch.bfloat16, 3, data, max_norm=0.05, overlap=False)
    for a, b in zip(ours.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    units = [opt.cpu.layout.numel[u] for u in opt.cpu.units]
    assert len(opt.cpu.host.spares.sizes()) == len(speculation_units(units, 14, 3 * MIB))


def test_zero_bound_speculates_nothing():
    _, opt, speculated = _run(torch.bfloat16, 0, batches(2, micro=1))
    assert not opt.cpu.speculate and speculated == [0, 0] and opt.cpu.host.spare_flat == []
