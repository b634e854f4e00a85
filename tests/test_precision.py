"""Narrow optimizer states (optimizer.exp_avg_dtype, exp_avg_sq_dtype: the precision-aware optimizer's moments)
on the CPU-stepped part: the update element-wise against a float64 reference of the same arithmetic, checkpoints
across state dtypes and fractions, and the tiny model's loss after 200 steps against fp32 states."""

from __future__ import annotations

import pytest
import torch
from optim_reference import HP, batches, groups, reference_f64, tiny_gpt, train_losses

from engine.optim import HybridDeviceOptimizer, HybridOptions, fused_kernel
from engine.optim.adam_math import Hyper, adamw_scalars
from engine.optim.cpu_arith import TensorStep, narrow_slice

NARROW = [torch.bfloat16, torch.float16]


def _slice(path: str):
    """The narrow pass of `path`: torch's ops (the fallback) or the compiled pass."""
    if path == "torch":
        return narrow_slice
    lib = fused_kernel.load()
    if lib is None:
        pytest.skip(f"the C pass did not build here: {fused_kernel.status()}")
    return lambda s, a, b: fused_kernel.narrow_slice(lib, a, b, s)


@pytest.mark.parametrize("m_dtype", NARROW + [torch.float32])
@pytest.mark.parametrize("v_dtype", NARROW)
@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("path", ["torch", "c"])
def test_narrow_update_against_float64(m_dtype, v_dtype, in_place, path):
    """Both passes round the moments to nearest even (bf16, fp16) after the fp32 update."""
    step_slice = _slice(path)
    gen = torch.Generator().manual_seed(0)
    n, step = 5000, 7
    h = Hyper(1e-3, 0.9, 0.95, 1e-8, 0.1, 0.0)
    p = torch.randn(n, generator=gen)
    m = (torch.randn(n, generator=gen) * 1e-2).to(m_dtype)
    v = (torch.rand(n, generator=gen) * 1e-4).to(v_dtype)
    g = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    want_p, want_m, want_v = reference_f64(p, m, v, g, h, step, m_dtype, v_dtype)
    outs = (p, m, v) if in_place else (torch.empty_like(p), torch.empty_like(m), torch.empty_like(v))
    half = torch.empty(n, dtype=torch.bfloat16)
    before = (p.clone(), m.clone(), v.clone())
    s = TensorStep(p, m, v, g, *outs, half, adamw_scalars(h, step, 1.0, 1.0))
    step_slice(s, 0, 3000)
    step_slice(s, 3000, n)
    p_out, m_out, v_out = outs
    assert m_out.dtype == m_dtype and v_out.dtype == v_dtype
    # the moments: the fp32 result rounded to nearest; fp32 and float64 agree to far below the narrow ulp, so
    # the stored value is the float64 one's nearest or, at a near-tie, its neighbour (at most one ulp apart)
    for got, want in ((m_out, want_m), (v_out, want_v)):
        if want.dtype == torch.float32:  # fp32 moments: the fp32 pass's rounding, a few ulps from float64
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)  # atol: fp32 ulp at |g|~1e-2
            continue
        ulp = (want.float().abs() * torch.finfo(want.dtype).eps).clamp_min(torch.finfo(want.dtype).tiny)
        assert ((got.float() - want.float()).abs() <= ulp).all()
        assert (got == want).float().mean() > 0.99  # nearly all bit-equal: round to nearest, not truncation
    torch.testing.assert_close(p_out.double(), want_p, rtol=2e-6, atol=1e-9)
    torch.testing.assert_close(half, p_out.bfloat16(), rtol=0, atol=0)
    if not in_place:
        for a, b in zip((p, m, v), before, strict=True):
            assert torch.equal(a, b)  # out of place leaves the inputs alone


@pytest.mark.parametrize("dtype", NARROW)
def test_c_pass_rounds_each_moment_as_torch_does(dtype):
    """The compiled pass on narrow moments against the fp32 pass on the same values widened, followed by torch's
    conversion (round to nearest even): the same fp32 arithmetic, the same rounding."""
    lib = _slice("c") and fused_kernel.load()
    gen = torch.Generator().manual_seed(3)
    n = 70000
    p, g = torch.randn(n, generator=gen), (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    m, v = (torch.randn(n, generator=gen) * 1e-2).to(dtype), (torch.rand(n, generator=gen) * 1e-4).to(dtype)
    sc = adamw_scalars(Hyper(1e-3, 0.9, 0.95, 1e-8, 0.1, 0.0), 3, 1.0, 1.0)
    wide = [p.clone(), m.float(), v.float()]
    fused_kernel.adamw_slice(lib, 0, n, *wide, g, None, *wide, None, sc)
    fused_kernel.narrow_slice(lib, 0, n, TensorStep(p, m, v, g, p, m, v, None, sc))
    assert torch.equal(p, wide[0])
    assert torch.equal(m, wide[1].to(dtype)) and torch.equal(v, wide[2].to(dtype))


def test_c_rounding_to_bf16_keeps_nans_nans_and_rounds_the_rest_as_torch():
    """The half weights the fp32 pass writes: a NaN whose low bits are set stays a NaN (a rounding bias added to it
    would carry into the sign and make it -0), an infinity stays one, the largest finite fp32 rounds to infinity
    and the rest to nearest even, as torch converts them. lr 0 and zero moments keep each weight as it was."""
    lib = _slice("c") and fused_kernel.load()
    special = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC0FFFF, 0xFF80FFFF, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x3F808000,
               0x3F818000, 0x00008000, 0x80018000, 0x3F80FFFF]  # fmt: skip
    n = 4096 + 5  # the vectorised body and a scalar tail
    bits = torch.randint(0, 1 << 31, (n,), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    bits[: len(special) * 300 : 300] = torch.tensor(special)  # spread over the body's lanes
    bits[-len(special) :] = torch.tensor(special)
    p = bits.to(torch.int32).view(torch.float32).clone()
    want = p.bfloat16()
    zeros = [torch.zeros(n), torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)]
    half = torch.empty(n, dtype=torch.bfloat16)
    sc = adamw_scalars(Hyper(0.0, 0.9, 0.95, 1e-8, 0.0, 0.0), 1, 1.0, 1.0)
    fused_kernel.adamw_slice(lib, 0, n, p, zeros[0], zeros[1], zeros[2], None, p, zeros[0], zeros[1], half, sc)
    assert torch.equal(half.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(half[finite].view(torch.int16), want[finite].view(torch.int16))


def _opt(model, fraction, m_dtype, v_dtype):
    opt = HybridDeviceOptimizer(groups(model, 0.1, named=True), HybridOptions(
        **HP, offload_fraction=fraction, overlap_cpu_optimizer_d2h_h2d=True, exp_avg_dtype=m_dtype,
        exp_avg_sq_dtype=v_dtype))  # fmt: skip
    opt.attach_model(model)
    return opt


def test_states_are_held_in_their_dtype():
    model = tiny_gpt()
    opt = _opt(model, 1.0, torch.bfloat16, torch.float32)
    train_losses(model, opt, batches(2, 1))
    st = opt.state_dict()["state"]
    assert {s["exp_avg"].dtype for s in st.values()} == {torch.bfloat16}
    assert {s["exp_avg_sq"].dtype for s in st.values()} == {torch.float32}
    assert {s["master"].dtype for s in st.values()} == {torch.float32}
    opt.close()


@pytest.mark.parametrize(("saved", "loaded"), [((torch.bfloat16, 1.0), (torch.float32, 0.5)),
                                               ((torch.float32, 0.5), (torch.bfloat16, 1.0))])  # fmt: skip
def test_checkpoint_across_state_dtypes_and_fractions(saved, loaded, caplog):
    model = tiny_gpt()
    opt = _opt(model, saved[1], saved[0], saved[0])
    train_losses(model, opt, batches(3, 1))
    state = opt.state_dict()
    resumed = tiny_gpt(seed=5)
    resumed.load_state_dict(model.state_dict())
    opt2 = _opt(resumed, loaded[1], loaded[0], loaded[0])
    with caplog.at_level("WARNING"):
        opt2.load_state_dict(state)
    assert any("exp_avg" in r.getMessage() and ("widened" in r.getMessage() or "narrowed" in r.getMessage())
               for r in caplog.records)  # fmt: skip
    back = opt2.state_dict()["state"]
    for n, st in state["state"].items():
        assert torch.equal(back[n]["master"], st["master"])
        for k in ("exp_avg", "exp_avg_sq"):
            # fp32 -> bf16 rounds to nearest; bf16 -> fp32 is exact
            torch.testing.assert_close(back[n][k].float(), st[k].float().to(loaded[0]).float(), rtol=0, atol=0)
    opt.close()
    opt2.close()


def test_tiny_model_loss_after_200_steps_near_fp32_states():
    """bf16 moments (round to nearest) against fp32 ones, same data and seed: the last 20 steps' mean loss
    within 2% (measured here: well inside it)."""
    data = batches(200, 1, seed=3)
    finals = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_gpt(seed=0)
        opt = _opt(model, 1.0, dtype, dtype)
        losses = train_losses(model, opt, data)
        opt.close()
        finals[dtype] = sum(losses[-20:]) / 20
        assert finals[dtype] < losses[0] - 0.5  # it learned
    assert abs(finals[torch.bfloat16] / finals[torch.float32] - 1) < 0.02, finals


def test_narrow_states_refused_where_no_mechanism_uses_them():
    for kw in (dict(optimizer="sgd"), dict(use_torch_optimizer_for_cpu_offload=True), dict(gpu_assist=True)):
        with pytest.raises(ValueError, match=r"exp_avg_dtype \(optimizer.exp_avg_dtype\)"):
            HybridOptions(lr=1e-3, offload_fraction=0.5, exp_avg_dtype=torch.bfloat16, **kw)
    with pytest.raises(ValueError, match=r"exp_avg_sq_dtype.*one of"):
        HybridOptions(lr=1e-3, exp_avg_sq_dtype=torch.float64)


@pytest.mark.parametrize("key", ["exp_avg_dtype", "exp_avg_sq_dtype"])
def test_fp16_moments_refused_when_built_by_hand(key):
    """The config refuses them; an optimizer built from engine.optim directly must too (stored unscaled, fp16 second
    moments underflow and the update explodes, fp16 first moments lose small values: +5.4% final loss over 1000
    steps), each naming its own option."""
    with pytest.raises(ValueError, match=rf"^{key} \(optimizer\.{key}\)=torch\.float16: fp16 moments .*"
                                         r"use torch\.bfloat16 \(the same 2 bytes"):  # fmt: skip
        HybridOptions(lr=1e-3, offload_fraction=0.5, **{key: torch.float16})
    assert HybridOptions(lr=1e-3, offload_fraction=0.5, **{key: torch.bfloat16}) is not None


# --- the config keys (megatron's names), the plan's bytes ---------------------------------------------------

OFFLOAD = ["optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=0.5",
           "optimizer.use_distributed_optimizer=true", "optimizer.overlap_cpu_optimizer_d2h_h2d=true"]  # fmt: skip
NARROW_KEYS = ["optimizer.use_precision_aware_optimizer=true", "optimizer.exp_avg_dtype=bf16",
               "optimizer.exp_avg_sq_dtype=bf16"]  # fmt: skip


def test_config_keys_reach_the_cpu_part_and_the_plan():
    from engine.build import build_optimizer
    from engine.config import load_config
    from engine.optim.param_groups import named_parameter_groups
    from engine.planning import plan

    model = tiny_gpt()
    cfg = load_config({}, overrides=OFFLOAD + NARROW_KEYS)
    opt = build_optimizer(named_parameter_groups(model, None, 0.0), cfg, model)
    opt._build()
    assert (opt.cpu.host.m.flat.dtype, opt.cpu.host.v.flat.dtype) == (torch.bfloat16, torch.bfloat16)
    opt.close()
    shape = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
             "model.vocab_size=256", "train.micro_batch_size=2", "train.global_batch_size=4"]  # fmt: skip
    plans = [plan(load_config({}, shape + OFFLOAD + extra), gpu_budget_bytes=1 << 30, host_budget_bytes=1 << 30)
             for extra in ([], NARROW_KEYS)]  # fmt: skip
    n_cpu = plans[0].cpu_parameters
    assert n_cpu > 0 and plans[1].cpu_parameters == n_cpu
    wide, thin = (p.to_json() for p in plans)
    for part in ("exp_avg", "exp_avg_sq"):
        assert wide["host"]["parts"][f"optimizer.{part}"] == 4 * n_cpu
        assert thin["host"]["parts"][f"optimizer.{part}"] == 2 * n_cpu
    assert load_config({}).optimizer.exp_avg_dtype == "fp32"  # default unchanged


@pytest.mark.parametrize(("over", "key"), [
    (OFFLOAD + ["optimizer.exp_avg_dtype=bf16"], "optimizer.exp_avg_dtype"),  # without the switch
    (OFFLOAD + ["optimizer.use_precision_aware_optimizer=true", "optimizer.exp_avg_sq_dtype=fp8"],
     "optimizer.exp_avg_sq_dtype"),
    (["optimizer.main_params_dtype=fp16"], "optimizer.main_params_dtype"),
    (["optimizer.main_grads_dtype=bf16"], "optimizer.main_grads_dtype"),
])  # fmt: skip
def test_what_is_not_built_is_refused_in_one_line(over, key):
    from engine.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config({}, overrides=over)
    assert key in str(e.value) and "\n" not in str(e.value).strip(), str(e.value)


@pytest.mark.parametrize(("key", "why"), [("exp_avg_dtype", "small first moments lose their precision"),
                                          ("exp_avg_sq_dtype", "underflow to 0")])  # fmt: skip
@pytest.mark.parametrize("switch", [True, False])
def test_fp16_moments_refused_by_the_config_in_one_line(key, why, switch):
    """optimizer.exp_avg_dtype / exp_avg_sq_dtype = "fp16" (a DeepSpeed or Megatron user's value): one line naming
    the key, why, and 'bf16', with or without the precision-aware switch (setting it would not help); the same
    reason HybridOptions gives."""
    from engine.config import ConfigError, load_config

    over = OFFLOAD + [f"optimizer.{key}=fp16"] + (["optimizer.use_precision_aware_optimizer=true"] if switch else [])
    with pytest.raises(ConfigError) as e:
        load_config({}, overrides=over)
    assert e.value.errors == [str(e.value).strip()], e.value.errors  # one problem, one line
    line = e.value.errors[0]
    assert line.startswith(f'optimizer.{key}="fp16": fp16 moments are stored unscaled here: ') and why in line, line
    assert line.endswith("; use 'bf16' (the same 2 bytes, fp32's range)"), line
    with pytest.raises(ValueError) as built:
        HybridOptions(lr=1e-3, offload_fraction=0.5, **{key: torch.float16})
    assert str(built.value).split("=torch.float16: ")[1].replace("torch.bfloat16", "'bf16'") == line.split(": ", 1)[1]


def test_bench_optimizer_refuses_fp16_moments_before_it_builds(capsys):
    """bin/bench optimizer's --forms takes bin/bench cpass's forms; fp16-m/v (the C pass's, stepped there directly)
    is refused up front with the optimizer's reason, not by a traceback after the model is built."""
    from engine.bench import optimizer as bench

    assert bench.main(["--forms", "bf16-m/v,fp16-m/v"]) == 2
    err = capsys.readouterr().err
    assert "--forms 'fp16-m/v': exp_avg_dtype (optimizer.exp_avg_dtype)=torch.float16: fp16 moments" in err, err
    assert bench._refusal("bf16-m/v") is None
