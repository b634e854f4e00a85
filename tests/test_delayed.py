"""optimizer.delayed_param_update on CPU: step by step against a hand-written reference of the delayed update,
warm-up steps exact, clipping and non-finite steps as engine/optim/delayed.py documents, resume bit for bit."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from optim_reference import HP, batches, groups, schedule, tiny_gpt

from engine.models.gpt import gpt_loss
from engine.optim import HybridDeviceOptimizer, HybridOptions, fused_kernel

FRACTION, WARMUP, MAX_NORM = 0.5, 3, 0.5


@pytest.fixture
def torch_kernels(monkeypatch):
    """torch's ops on both sides of the comparison (the compiled pass rounds as CUDA does): bit for bit."""
    monkeypatch.setattr(fused_kernel, "_lib", None)
    monkeypatch.setattr(fused_kernel, "_tried", True)


def _loss(model, tokens, scale):
    return gpt_loss(model(tokens), tokens) * scale


def reference(model, data, cpu_names, *, warmup, max_norm=MAX_NORM, bad=()):
    """The documented semantics written out plainly: one fp32 AdamW over the masters, exact; the model's weights
    are the masters, except the CPU-stepped ones after a delayed step, which are the masters before it.
    Yields (weights the next forward reads, masters, delayed) after each step."""
    visible, master = copy.deepcopy(model), copy.deepcopy(model)
    opt = torch.optim.AdamW(groups(master, 0.1, named=False), **HP, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    taken = 0
    for s, micro in enumerate(data):
        visible.zero_grad(set_to_none=True)
        for tokens in micro:
            _loss(visible, tokens, float("nan") if s in bad else 1.0 / len(micro)).backward()
        for m, v in zip(master.parameters(), visible.parameters(), strict=True):
            m.grad = v.grad.clone()
        norm = torch.nn.utils.clip_grad_norm_(master.parameters(), max_norm)
        before = {n: p.detach().clone() for n, p in master.named_parameters()}
        delayed = False
        if torch.isfinite(norm):  # else skipped: nothing steps, the last delayed update has landed
            delayed = taken >= warmup
            opt.step()
            sched.step()
            taken += 1
        with torch.no_grad():
            for n, p in visible.named_parameters():
                p.copy_(before[n] if delayed and n in cpu_names else dict(master.named_parameters())[n])
        yield copy.deepcopy(visible.state_dict()), copy.deepcopy(master.state_dict()), delayed


def make(model, *, warmup=WARMUP, overlap=True, **kw):
    opt = HybridDeviceOptimizer(groups(model, 0.1, named=True), HybridOptions(**HP, offload_fraction=FRACTION,
                                overlap_cpu_optimizer_d2h_h2d=overlap, delayed_param_update=True,
                                delayed_param_update_warmup=warmup, **kw))  # fmt: skip
    opt.attach_model(model)
    return opt


def ours(model, data, opt, *, max_norm=MAX_NORM, bad=(), start=0):
    """The same loop through the hybrid optimizer; yields (weights, masters, delayed) after each step."""
    for g in opt.param_groups:
        g.setdefault("initial_lr", g["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule, last_epoch=start - 1)
    for s, micro in enumerate(data, start):
        opt.zero_grad()
        for i, tokens in enumerate(micro):
            opt.set_grad_final(i == len(micro) - 1)
            _loss(model, tokens, float("nan") if s in bad else 1.0 / len(micro)).backward()
        _, stepped = opt.clip_and_step(max_norm)
        if stepped:
            sched.step()
        opt.synchronize()  # waits for the CPU step; lands nothing: the weights are what the next forward reads
        masters = {n: st["master"] for n, st in opt.state_dict()["state"].items()}
        yield copy.deepcopy(model.state_dict()), masters, opt.last_step_delayed


def assert_same(got, want, step):
    (w, m, d), (rw, rm, rd) = got, want
    assert d == rd, f"step {step}: delayed {d}, reference {rd}"
    for n in rw:
        assert torch.equal(w[n], rw[n]), f"step {step}: weight {n}"
        assert torch.equal(m[n].reshape(rm[n].shape), rm[n]), f"step {step}: master {n}"


@pytest.mark.parametrize("overlap", [True, False])
def test_step_by_step_against_the_reference(torch_kernels, overlap):
    """Accumulation over 2 micro-batches, active clipping (whose norm includes the CPU part's gradients), an
    LR that changes every step; 3 exact warm-up steps, then delayed ones."""
    model, data = tiny_gpt(), batches(9, micro=2)
    mine = copy.deepcopy(model)
    opt = make(mine, overlap=overlap)
    cpu_names = set(opt.cpu_names)
    assert cpu_names and len(cpu_names) < len(opt.names)
    steps = list(zip(ours(mine, data, opt), reference(model, data, cpu_names, warmup=WARMUP), strict=True))
    for s, (got, want) in enumerate(steps):
        assert_same(got, want, s)
    assert [d for (_, _, d), _ in steps] == [False] * WARMUP + [True] * (9 - WARMUP)
    # the delayed run is not the exact run: the CPU-stepped weights lag, so later gradients differ
    exact = list(reference(model, data, cpu_names, warmup=100))
    assert any(not torch.equal(steps[-1][0][0][n], exact[-1][0][n]) for n in opt.names if n not in cpu_names)


@pytest.mark.parametrize("use_torch", [False, True], ids=["compiled-pass", "torch.optim"])
def test_other_arithmetic_to_rounding(use_torch):
    """The engine's own compiled AdamW pass (when it builds here), or torch.optim stepping the host part
    (use_torch_optimizer_for_cpu_offload): the reference to their rounding."""
    if not use_torch and fused_kernel.load() is None:
        pytest.skip("Requires: the compiled AdamW pass (a C compiler)")
    model, data = tiny_gpt(), batches(7, micro=1)
    mine = copy.deepcopy(model)
    opt = make(mine, use_torch_optimizer_for_cpu_offload=use_torch)
    assert bool(opt.cpu.inner) == use_torch
    expected = reference(model, data, opt.cpu_names, warmup=WARMUP)
    for s, ((w, _, d), (rw, _, rd)) in enumerate(zip(ours(mine, data, opt), expected, strict=True)):
        assert d == rd
        for n in rw:
            scale = max(rw[n].abs().max().item(), 1e-2)
            assert (w[n] - rw[n]).abs().max().item() / scale <= 1e-6, (s, n)


def test_warmup_longer_than_the_run_is_the_exact_run(torch_kernels):
    model, data = tiny_gpt(), batches(5, micro=1)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    delayed = list(ours(a, data, make(a, warmup=5)))
    exact_opt = HybridDeviceOptimizer(groups(b, 0.1, named=True), HybridOptions(**HP, offload_fraction=FRACTION,
                                      overlap_cpu_optimizer_d2h_h2d=True))  # fmt: skip
    exact_opt.attach_model(b)
    exact = list(ours(b, data, exact_opt))
    for (w, m, d), (ew, em, _) in zip(delayed, exact, strict=True):
        assert not d
        assert all(torch.equal(w[n], ew[n]) and torch.equal(m[n], em[n]) for n in w)


def test_non_finite_step_skips_and_lands_the_pending_update(torch_kernels):
    """Step 5 (delayed regime) has NaN gradients: nothing steps, the CPU part's gradients of step 5 are dropped,
    step 4's update lands before step 6; the skipped step does not count towards the warm-up (step 3 is bad too)."""
    model, data = tiny_gpt(), batches(9, micro=1)
    mine = copy.deepcopy(model)
    opt = make(mine)
    bad = (2, 5)
    got = list(ours(mine, data, opt, bad=bad))
    want = list(reference(model, data, opt.cpu_names, warmup=WARMUP, bad=bad))
    for s, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, s)
    assert [d for _, _, d in got] == [False, False, False, False, True, False, True, True, True]


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize(("dtype", "remainders"), [(torch.float32, False), (torch.bfloat16, False),
                                                  (torch.bfloat16, True)])  # fmt: skip
def test_resume_under_delay_is_bit_for_bit(torch_kernels, dtype, remainders):
    """Saved after a delayed step (an update pending), loaded into a fresh model and optimizer: the rest of the
    run equals the uninterrupted run's, weights and masters, bit for bit. With the remainder master the
    masters' high halves are in the shadow then, not the model: saved from it and resumed into it."""
    model, data = tiny_gpt(dtype=dtype), batches(9, micro=2)
    whole = copy.deepcopy(model)
    full = list(ours(whole, data, make(whole, store_param_remainders=remainders)))
    first = copy.deepcopy(model)
    opt = make(first, store_param_remainders=remainders)
    list(ours(first, data[:6], opt))
    saved_opt, saved_model = _roundtrip(opt.state_dict()), _roundtrip(first.state_dict())
    assert saved_opt["delayed"]["pending"] == sorted(opt.cpu_names) and saved_opt["delayed"]["taken"] == 6
    opt.close()
    fresh = tiny_gpt(seed=7, dtype=dtype)  # other weights: everything must come from the checkpoint
    fresh.load_state_dict(saved_model)
    opt2 = make(fresh, store_param_remainders=remainders)
    opt2.load_state_dict(saved_opt)
    rest = list(ours(fresh, data[6:], opt2, start=6))
    for s, ((w, m, d), (fw, fm, fd)) in enumerate(zip(rest, full[6:], strict=True), 6):
        assert d == fd
        for n in fw:
            assert torch.equal(w[n], fw[n]), (s, n)
            assert torch.equal(m[n], fm[n]), (s, n)


def test_loaded_without_the_option_the_pending_update_lands(torch_kernels):
    model, data = tiny_gpt(), batches(6, micro=1)
    opt = make(model)
    list(ours(model, data, opt))
    state = opt.state_dict()
    plain = HybridDeviceOptimizer(groups(model, 0.1, named=True), HybridOptions(**HP, offload_fraction=FRACTION))
    plain.attach_model(model)
    plain.load_state_dict(state)
    for n, p in model.named_parameters():
        assert torch.equal(p, state["state"][n]["master"].reshape(p.shape)), n


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(offload_fraction=0.0), "optimizer.optimizer_offload_fraction > 0"),
        (dict(offload_fraction=0.5, gpu_assist=True), "do not combine"),
        (dict(offload_fraction=0.5, delayed_param_update_warmup=-1), "delayed_param_update_warmup"),
    ],
)
def test_optimizer_that_cannot_delay_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        HybridDeviceOptimizer(tiny_gpt().named_parameters(), HybridOptions(lr=1e-3, delayed_param_update=True, **kw))


# --- through the engine: config, metrics, checkpoints -------------------------------------------------------

ENGINE = {
    "model": {"num_layers": 3, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 256},
    "optimizer": {"lr": 1e-3, "clip_grad": 0.5, "optimizer_cpu_offload": True, "use_distributed_optimizer": True,
                  "optimizer_offload_fraction": 0.5, "overlap_cpu_optimizer_d2h_h2d": True,
                  "delayed_param_update": True, "delayed_param_update_warmup": 2},
    "train": {"train_iters": 6, "global_batch_size": 4, "micro_batch_size": 2, "precision": "bf16",
              "params_dtype": "half", "seed": 3},
    "data": {"max_bytes": 200000},
    "logging": {"metrics_file": None, "progress_bar": False},
}  # fmt: skip


def test_engine_resume_under_delay_is_bit_for_bit(tmp_path):
    """bf16 half weights, fp32 masters, the engine's own AdamW pass: a run saved after a delayed step and resumed
    in a fresh engine gives the uninterrupted run's losses and weights, bit for bit; the engine reports which
    steps were delayed."""
    from engine import initialize

    eng, _, _ = initialize(config=ENGINE)
    losses, delayed = [], []
    for _ in range(6):
        losses.append(eng.train_batch())
        delayed.append(eng.last_step_delayed)
        if eng.iteration == 3:
            eng.save_checkpoint(str(tmp_path))
    eng.synchronize()
    final = {k: v.clone() for k, v in eng.module.state_dict().items()}
    eng.optimizer.close()
    assert delayed == [False, False, True, True, True, True]

    resumed, _, _ = initialize(config=ENGINE)
    with torch.no_grad():
        for p in resumed.module.parameters():
            p.add_(1.0)  # everything must come from the checkpoint
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.iteration == 3
    rest = [resumed.train_batch() for _ in range(3)]
    assert rest == losses[3:]
    resumed.synchronize()
    for k, v in resumed.module.state_dict().items():
        assert torch.equal(v, final[k]), k
    resumed.optimizer.close()


def test_memory_plan_counts_the_shadow_and_no_speculation():
    """The plan's GPU part `delayed_update_shadow` is the bytes of the shadow the optimizer really holds, and the
    host plan has no speculation spares (a delayed step does not speculate)."""
    import engine
    from engine.config import load_config
    from engine.models.gpt import GPT
    from engine.optim.param_groups import named_parameter_groups

    cfg = load_config(ENGINE)
    plan = engine.plan(cfg, gpu_budget_bytes=8 << 30, host_budget_bytes=8 << 30)
    exact_optimizer = {k: v for k, v in ENGINE["optimizer"].items() if k != "delayed_param_update_warmup"}
    exact = engine.plan(load_config({**ENGINE, "optimizer": {**exact_optimizer, "delayed_param_update": False}}),
                        gpu_budget_bytes=8 << 30, host_budget_bytes=8 << 30)  # fmt: skip
    m = cfg.model
    model = GPT(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                seq_length=m.seq_length, vocab_size=m.vocab_size).to(torch.bfloat16)  # fmt: skip
    opt = HybridDeviceOptimizer(named_parameter_groups(model, None, 0.0), HybridOptions(lr=1e-3, offload_fraction=0.5,
                                overlap_cpu_optimizer_d2h_h2d=True, delayed_param_update=True))  # fmt: skip
    opt.attach_model(model)
    shadow = sum(t.numel() * t.element_size() for t in opt.delayed.shadow.values())
    opt.close()
    assert shadow > 0 and plan.gpu.parts["delayed_update_shadow"] == shadow
    assert exact.gpu.parts["delayed_update_shadow"] == 0
    assert plan.host.parts.get("optimizer.speculation", 0) == 0 < exact.host.parts["optimizer.speculation"]
