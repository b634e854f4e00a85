"""megatron-core integration on CPU: a tiny megatron-core GPTModel built from our `model.*`, its adapter, the
CPU core attention checked element-wise against megatron's own, activation offloading on `decoder.layers`,
and megatron's optimizer behind the engine's step protocol. GPU-only parts (megatron's HybridDeviceOptimizer,
megatron's own DotProductAttention) are marked `gpu`."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="Requires: megatron-core")

from engine import megatron  # noqa: E402

SHAPE = SimpleNamespace(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=None,
    seq_length=16,
    vocab_size=64,
    init_method_std=0.02,
    use_te=False,
    recompute_granularity=None,
)
OPT = SimpleNamespace(
    optimizer="adam",
    lr=1e-2,
    weight_decay=0.1,
    adam_beta1=0.9,
    adam_beta2=0.95,
    adam_eps=1e-8,
    sgd_momentum=0.9,
    optimizer_cpu_offload=False,
    optimizer_offload_fraction=0.5,
    overlap_cpu_optimizer_d2h_h2d=False,
    pin_cpu_grads=True,
    pin_cpu_params=True,
)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA")


@pytest.fixture(scope="module", autouse=True)
def _parallel_state():
    # megatron-core's state is process-global: undo what this module set up so other tests see none of it
    yield
    megatron.teardown()


def build(seed: int = 0, device: str = "cpu", **kw) -> megatron.MegatronGPT:
    torch.manual_seed(seed)
    return megatron.build_gpt(SimpleNamespace(**{**vars(SHAPE), **kw}), device=device)


def tokens(seed: int = 1, b: int = 2, s: int = 16) -> torch.Tensor:
    return torch.randint(0, SHAPE.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))


def loss_of(model, toks: torch.Tensor) -> torch.Tensor:
    # the engine's loss: next-token cross entropy over logits [b, s, v] against labels [b, s]
    return F.cross_entropy(model(toks[:, :-1]).float().flatten(0, 1), toks[:, 1:].flatten())


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_megatron_gpt_gives_logits_b_s_v_and_exposes_decoder_layers():
    from megatron.core.models.gpt import GPTModel

    model = build()
    assert isinstance(model.gpt, GPTModel)
    assert isinstance(model.gpt.decoder.layers, torch.nn.ModuleList) and len(model.gpt.decoder.layers) == 2
    assert model.layers is model.gpt.decoder.layers
    assert model(tokens()).shape == (2, 16, SHAPE.vocab_size)
    assert megatron.is_gpt_model(model.gpt) and not megatron.is_gpt_model(model)


def test_attention_is_causal():
    model = build()
    a, b = tokens(1), tokens(1).clone()
    b[:, 8:] = (b[:, 8:] + 1) % SHAPE.vocab_size  # change only the future of position 7
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :8], lb[:, :8], rtol=0, atol=0)
    assert not torch.allclose(la[:, 8:], lb[:, 8:])


def test_same_seed_builds_give_the_same_weights_and_gradients():
    m1, m2 = build(seed=3), build(seed=3)
    for (n1, p1), (n2, p2) in zip(m1.named_parameters(), m2.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1
    loss_of(m1, tokens()).backward()
    loss_of(m2, tokens()).backward()
    g1, g2 = grads(m1), grads(m2)
    assert all(g.abs().sum() > 0 for g in g1.values())  # every parameter takes part
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n
    assert not torch.equal(build(seed=4).gpt.output_layer.weight, m1.gpt.output_layer.weight)


def test_a_users_gpt_model_gets_the_adapter():
    gpt = build().gpt
    wrapped = megatron.as_engine_module(gpt)
    assert isinstance(wrapped, megatron.MegatronGPT) and wrapped.gpt is gpt
    assert wrapped(tokens()).shape == (2, 16, SHAPE.vocab_size)


def test_ensure_model_parallel_keeps_existing_state():
    from megatron.core import parallel_state

    megatron.ensure_model_parallel(device="cpu")
    group = parallel_state.get_tensor_model_parallel_group()
    megatron.ensure_model_parallel(device="cpu")
    assert parallel_state.get_tensor_model_parallel_group() is group
    assert parallel_state.get_tensor_model_parallel_world_size() == 1


class _HostBuffer:
    def get_tensor(self, shape, dtype, name):
        return torch.empty(shape, dtype=dtype)


class _NoRngTracker:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
def test_sdpa_core_attention_matches_megatrons_dot_product_attention(monkeypatch, groups):
    from megatron.core.transformer import dot_product_attention as dpa
    from megatron.core.transformer.enums import AttnMaskType

    from engine.megatron.attention import SDPACoreAttention

    # megatron's module needs CUDA only for its score buffer and RNG fork (dropout is 0): give it host ones
    monkeypatch.setattr(dpa.parallel_state, "get_global_memory_buffer", lambda: _HostBuffer())
    monkeypatch.setattr(dpa.tensor_parallel, "get_cuda_rng_tracker", lambda: _NoRngTracker())
    megatron.ensure_model_parallel(device="cpu")
    cfg = megatron.transformer_config(SHAPE, num_query_groups=groups)
    ref = dpa.DotProductAttention(cfg, 1, AttnMaskType.causal, "self")
    ours = SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self")
    s, b, hn = 16, 2, SHAPE.hidden_size // SHAPE.num_attention_heads
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, 4, hn, generator=gen, requires_grad=True)
    k, v = (torch.randn(s, b, groups, hn, generator=gen, requires_grad=True) for _ in range(2))
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]  # True = masked, megatron's convention
    out_ref = ref(q, k, v, causal)
    g = torch.randn(out_ref.shape, generator=gen)
    grads_ref = torch.autograd.grad(out_ref, (q, k, v), g)
    for mask in (None, causal):  # causal from the mask type, and from an explicit mask
        out = ours(q, k, v, mask)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
        for a, r in zip(torch.autograd.grad(out, (q, k, v), g), grads_ref, strict=True):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the CPU error; CUDA is present")
def test_megatrons_own_attention_on_cpu_is_refused_with_the_reason():
    with pytest.raises(RuntimeError, match=r"DotProductAttention needs CUDA .*core_attention='sdpa'"):
        megatron.build_gpt(SHAPE, device="cpu", core_attention="megatron")


def test_cpu_autocast_training_is_refused_with_the_fix():
    model = build()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="train.precision='fp32'"):
        model(tokens())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(tokens()).shape == (2, 16, SHAPE.vocab_size)  # evaluation has no backward to break


def test_half_weights_train_on_cpu():
    model = build().to(torch.bfloat16)
    loss_of(model, tokens()).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_recompute_on_cpu_is_refused_with_the_fix():
    with pytest.raises(RuntimeError, match="model.recompute_granularity=null"):
        build(recompute_granularity="full")


def test_activation_offloading_of_decoder_layers_gives_the_same_gradients_and_weights():
    from engine import offload

    ref, off = build(seed=5), build(seed=5)
    assert offload.find_layers(off) is off.gpt.decoder.layers
    handle = offload.apply_activation_offloading(off, num_layers=1, min_bytes=0)
    opt_ref = megatron.build_hybrid_optimizer(ref, OPT)
    opt_off = megatron.build_hybrid_optimizer(off, OPT)
    moved = 0
    for step in range(3):
        toks = tokens(seed=10 + step)
        loss_ref, loss_off = loss_of(ref, toks), loss_of(off, toks)
        moved = max(moved, handle.host_bytes())
        loss_ref.backward()
        loss_off.backward()
        assert torch.equal(loss_ref, loss_off)
        for (n, a), (_, b) in zip(ref.named_parameters(), off.named_parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), n
        opt_ref.clip_and_step(1.0)
        opt_off.clip_and_step(1.0)
        opt_ref.zero_grad()
        opt_off.zero_grad()
    assert moved > 0  # layer 0 really went through the host
    for (n, a), (_, b) in zip(ref.named_parameters(), off.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    handle.remove()


def test_megatron_optimizer_steps_like_torch_adamw_with_clipping_and_schedule():
    model, ref = build(seed=6), build(seed=6)
    opt = megatron.build_hybrid_optimizer(model, OPT)
    assert isinstance(opt.inner, torch.optim.AdamW)  # megatron's fallback Adam without TE or Apex
    groups = megatron.megatron_param_groups(ref, OPT.weight_decay)
    ref_opt = torch.optim.AdamW(groups, lr=OPT.lr, betas=(OPT.adam_beta1, OPT.adam_beta2), eps=OPT.adam_eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda step: 1.0 / (step + 1))
    for step in range(3):
        toks = tokens(seed=20 + step)
        (loss_of(model, toks) * 8.0).backward()  # as if loss-scaled by 8
        loss_of(ref, toks).backward()
        # the adapter clips over its groups' parameters; same order, same rounding
        ref_norm = torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 0.5)
        norm, stepped = opt.clip_and_step(0.5, grad_scale=8.0)
        ref_opt.step()
        assert stepped and norm == pytest.approx(float(ref_norm), rel=1e-5)
        sched.step()
        ref_sched.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert opt.inner.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    for (n, a), (_, b) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=n)
    assert opt.state_dict()["state"]  # the state is the inner optimizer's


def test_megatron_optimizer_skips_a_non_finite_step():
    model = build(seed=7)
    opt = megatron.build_hybrid_optimizer(model, OPT)
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model, tokens()).backward()
    next(model.parameters()).grad[0].fill_(float("inf"))
    norm, stepped = opt.clip_and_step(1.0)
    assert not stepped and not torch.isfinite(torch.tensor(norm))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_engine_style_named_groups_are_accepted():
    model = build(seed=8)
    named = [
        {"params": [(n, p) for n, p in model.named_parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [(n, p) for n, p in model.named_parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = megatron.build_hybrid_optimizer(model, OPT, param_groups=named)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_optimizer_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    model = build(seed=10)
    opt = megatron.build_hybrid_optimizer(model, OPT)
    for g in opt.inner.param_groups:  # HybridDeviceOptimizer keeps its sub-optimizer classes in its groups
        g["cpu_optimizer_cls"] = torch.optim.AdamW
    loss_of(model, tokens()).backward()
    opt.clip_and_step(1.0)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)  # as the engine's checkpoints load
    assert loaded["param_groups"][0]["cpu_optimizer_cls"] == "torch.optim.adamw.AdamW"
    fresh = megatron.build_hybrid_optimizer(model, OPT)
    for g in fresh.inner.param_groups:
        g["cpu_optimizer_cls"] = torch.optim.AdamW
    fresh.load_state_dict(loaded)
    assert fresh.param_groups is fresh.inner.param_groups
    assert fresh.inner.param_groups[0]["cpu_optimizer_cls"] is torch.optim.AdamW
    p = next(model.parameters())
    assert torch.equal(fresh.inner.state[p]["exp_avg_sq"], opt.inner.state[p]["exp_avg_sq"])
    sched = torch.optim.lr_scheduler.LambdaLR(fresh, lambda step: 0.25)
    assert fresh.inner.param_groups[0]["lr"] == OPT.lr * 0.25 and sched.get_last_lr()[0] == OPT.lr * 0.25


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the CPU error; CUDA is present")
def test_hybrid_device_optimizer_on_cpu_is_refused_with_the_reason():
    cfg = SimpleNamespace(**{**vars(OPT), "optimizer_cpu_offload": True})
    with pytest.raises(RuntimeError, match=r"HybridDeviceOptimizer .*CUDA streams.*optimizer.implementation='engine'"):
        megatron.build_hybrid_optimizer(build(), cfg)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_hybrid_device_optimizer_matches_torch_adamw_on_cuda(fraction):
    cfg = SimpleNamespace(
        **{
            **vars(OPT),
            "optimizer_cpu_offload": True,
            "optimizer_offload_fraction": fraction,
            "overlap_cpu_optimizer_d2h_h2d": True,
            # eps 1e-5: the key bias gets only rounding noise as gradient, which Adam at eps 1e-8 turns into
            # full-size steps whose sign any difference in summation order flips (seen on the H200)
            "adam_eps": 1e-5,
        }
    )
    model, ref = build(seed=9).cuda(), build(seed=9).cuda()
    opt = megatron.build_hybrid_optimizer(model, cfg)
    groups = megatron.megatron_param_groups(ref, OPT.weight_decay)
    ref_opt = torch.optim.AdamW(groups, lr=OPT.lr, betas=(OPT.adam_beta1, OPT.adam_beta2), eps=cfg.adam_eps)
    for step in range(3):
        toks = tokens(seed=30 + step).cuda()
        loss_of(model, toks).backward()
        loss_of(ref, toks).backward()
        torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
        ref_opt.step()
        assert opt.clip_and_step(1.0)[1]
        opt.zero_grad()
        ref_opt.zero_grad()
    for (n, a), (_, b) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=n)


def test_initialize_builds_and_trains_the_megatron_gpt(tiny_config):
    import engine

    eng, _, _ = engine.initialize(
        config=tiny_config,
        overrides=[
            "model.implementation=megatron",
            "optimizer.lr=3e-3",
            "optimizer.lr_decay_style=constant",
            "train.train_iters=12",
        ],
    )
    assert type(eng.module).__name__ == "MegatronGPT"
    losses = [eng.train_batch() for _ in range(12)]
    assert losses[-1] < 0.85 * losses[0]


def test_group_step_counts_of_fused_adams_survive_a_checkpoint(tmp_path):
    """TE's and Apex's FusedAdam count steps in their groups; megatron's HybridDeviceOptimizer saves only its own
    groups, the adapter saves its sub-optimizers' counts too (on the H200 a load without them restarted the bias
    correction: loss off by 0.21)."""
    from engine.megatron.optimizer import MegatronOptimizerAdapter

    def hdo_like() -> MegatronOptimizerAdapter:
        params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
        wrapper = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}])
        wrapper.sub_optimizers = [torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}])]
        return MegatronOptimizerAdapter(wrapper)

    opt = hdo_like()
    opt.inner.sub_optimizers[0].param_groups[0]["step"] = 7  # as FusedAdam keeps it; group 1 never stepped
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    fresh = hdo_like()
    fresh.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    assert fresh.inner.sub_optimizers[0].param_groups[0]["step"] == 7
    assert "step" not in fresh.inner.sub_optimizers[0].param_groups[1]


def test_clipping_gradient_tensors_equals_torchs_clipping_of_parameters():
    from engine.optim.protocol import unscale_and_clip_grads_

    gen = torch.Generator().manual_seed(0)
    a = [torch.nn.Parameter(torch.zeros(n)) for n in (7, 300)]
    for p in a:
        p.grad = torch.randn(p.shape, generator=gen) * 3
    grads = [p.grad.clone() for p in a]
    for p in a:
        p.grad /= 4.0
    norm = torch.nn.utils.clip_grad_norm_(a, 1.0, foreach=True)
    d = unscale_and_clip_grads_(grads, 1.0, grad_scale=4.0)
    assert d.norm == float(norm) and d.ok
    assert all(torch.equal(p.grad, g) for p, g in zip(a, grads, strict=True))


def _fp32_master_reference(model, groups, steps, lr):
    """torch AdamW over fp32 copies of the bf16 weights, gradients widened then clipped: Megatron's mixed precision."""
    masters = [[p.detach().float() for p in g["params"]] for g in groups]
    ref = torch.optim.AdamW(
        [{**g, "params": m} for g, m in zip(groups, masters, strict=True)],
        lr=lr, betas=(OPT.adam_beta1, OPT.adam_beta2), eps=OPT.adam_eps,
    )  # fmt: skip
    flat = [(p, m) for g, ms in zip(groups, masters, strict=True) for p, m in zip(g["params"], ms, strict=True)]
    for step in range(steps):
        loss_of(model, tokens(seed=40 + step)).backward()
        for p, m in flat:
            m.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_([m for _, m in flat], 1.0)
        ref.step()
        with torch.no_grad():
            for p, m in flat:
                p.copy_(m)
    return flat


def test_megatron_optimizer_steps_half_weights_through_fp32_masters():
    """bf16 weights under megatron's plain Adam: the update goes to an fp32 master (in place on bf16 it would vanish
    below half an ulp), bit for bit Megatron's mixed-precision step; the masters survive a checkpoint."""
    lr = 1e-4  # updates of ~1e-4 on weights of ~0.02: below half a bf16 ulp, lost without a master
    cfg = SimpleNamespace(**{**vars(OPT), "lr": lr})
    model, ref = build(seed=11).to(torch.bfloat16), build(seed=11).to(torch.bfloat16)
    opt = megatron.build_hybrid_optimizer(model, cfg)
    assert opt.masters and all(m.dtype == torch.float32 for _, m in opt.masters)
    for step in range(4):
        loss_of(model, tokens(seed=40 + step)).backward()
        assert opt.clip_and_step(1.0)[1]
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    flat = _fp32_master_reference(ref, megatron.megatron_param_groups(ref, OPT.weight_decay), 4, lr)
    for (p, m), (q, r) in zip(opt.masters, flat, strict=True):
        assert torch.equal(m, r) and torch.equal(p, q)
    # the masters hold what the bf16 weights cannot: progress below half an ulp
    assert all(not torch.equal(m, p.float()) for p, m in opt.masters if p.dim() == 2)

    sd = opt.state_dict()
    fresh = megatron.build_hybrid_optimizer(model, cfg)
    fresh.load_state_dict(sd)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(fresh.masters, opt.masters, strict=True))
    del sd["fp32_from_fp16_params"]  # a checkpoint from before the masters: they restart from the weights
    fresh.load_state_dict(sd)
    assert all(torch.equal(m, p.float()) for p, m in fresh.masters)


def test_the_hybrid_device_optimizer_gets_fp32_gradients_of_half_weights():
    """megatron's HybridDeviceOptimizer (CUDA only) reads `decoupled_grad` before `.grad`: the adapter widens half
    gradients into it and clips there, so no clip coefficient is rounded into a bf16 gradient."""
    from engine.megatron.optimizer import MegatronOptimizerAdapter

    p = torch.nn.Parameter(torch.full((64,), 0.5, dtype=torch.bfloat16))
    inner = torch.optim.SGD([p], lr=0.0)
    inner.param_update_in_fp32 = True  # as megatron's HybridDeviceOptimizer is built
    p.grad = torch.linspace(1, 3, 64).to(torch.bfloat16)
    expect = p.grad.float()
    expect = expect * torch.clamp(0.3 / (expect.norm() + 1e-6), max=1.0)
    bf16_grad = p.grad.clone()
    MegatronOptimizerAdapter(inner).clip_and_step(0.3)
    assert p.decoupled_grad.dtype == torch.float32 and torch.equal(p.decoupled_grad, expect)
    assert torch.equal(p.grad, bf16_grad)  # the bf16 gradient is left as it came
