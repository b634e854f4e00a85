"""Narrow optimizer states on the GPU-stepped part (engine/optim/gpu_narrow.py): bf16/fp16 exp_avg/exp_avg_sq and
the remainder master where the parameters are stepped on their own device. The update element-wise against a
float64 reference of the same arithmetic; the remainder form bit-equal to the fp32 master over several steps; the
plan's bytes against the tensors held; checkpoints across state dtypes; fraction 0 through the config keys."""

from __future__ import annotations

import pytest
import torch
from optim_reference import HP, batches, groups, reference_f64, tiny_gpt, train_losses

from engine.optim import HybridDeviceOptimizer, HybridOptions, gpu_narrow, remainder
from engine.optim.adam_math import Hyper
from engine.optim.gpu_narrow import NarrowGpuPart
from engine.optim.gpu_side import GpuPart, gpu_side_bytes

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="Requires: CUDA")])  # fmt: skip
HYPERS = [Hyper(1e-2, 0.9, 0.95, 1e-8, 0.1, 0.0), Hyper(2e-3, 0.8, 0.99, 1e-6, 0.0, 0.0)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _params(device: str, dtype: torch.dtype) -> list[tuple[str, torch.nn.Parameter, int]]:
    """Three parameters in two groups, sizes that make a 3000-element staging slice split and join them."""
    g = torch.Generator().manual_seed(0)
    shapes = {"a": ((5000,), 0), "b": ((40, 50), 0), "c": ((700,), 1)}
    return [(n, torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)), gi)
            for n, (s, gi) in shapes.items()]  # fmt: skip


@pytest.fixture
def small_slices(monkeypatch):
    monkeypatch.setattr(gpu_narrow, "STAGING_ELEMS", 3000)  # slices cross tensors and split them


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize(("m_dtype", "v_dtype", "rem"), [(BF16, BF16, False), (FP16, BF16, False),
                         (FP32, FP16, False), (BF16, BF16, True), (FP32, FP32, True), (BF16, FP16, True)])  # fmt: skip
def test_update_against_float64(device, m_dtype, v_dtype, rem, small_slices):
    """One step from stored states (step 6): the fp32 update of the widened states, the moments rounded to nearest
    into their dtypes, the weights the master's nearest (ties away from zero in the remainder form)."""
    entries = _params(device, BF16)
    part = NarrowGpuPart(entries, moment_dtypes=(m_dtype, v_dtype), remainders=rem)
    gen = torch.Generator().manual_seed(1)
    saved, grads = {}, {}
    for n, p, _ in entries:
        saved[n] = {"step": 6, "master": torch.randn(p.shape, generator=gen),
                    "exp_avg": (torch.randn(p.shape, generator=gen) * 1e-2).to(m_dtype),
                    "exp_avg_sq": (torch.rand(p.shape, generator=gen) * 1e-4).to(v_dtype)}  # fmt: skip
        part.load(n, saved[n])
        grads[n] = (torch.randn(p.shape, generator=gen) * 10).bfloat16().to(device)  # loss-scaled by 1024
    inv_scale, coef = 1 / 1024, 0.7
    part.step(grads, HYPERS, inv_scale, coef)
    for n, p, gi in entries:
        st, was = part.export(n), saved[n]
        g = grads[n].cpu().float() * inv_scale * coef  # the same two fp32 multiplies
        want_p, want_m, want_v = reference_f64(was["master"], was["exp_avg"], was["exp_avg_sq"], g, HYPERS[gi], 7,
                                               m_dtype, v_dtype)  # fmt: skip
        assert st["step"] == 7 and st["exp_avg"].dtype == m_dtype and st["exp_avg_sq"].dtype == v_dtype
        for got, want in ((st["exp_avg"], want_m), (st["exp_avg_sq"], want_v)):
            if want.dtype == FP32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
                continue
            ulp = (want.float().abs() * torch.finfo(want.dtype).eps).clamp_min(torch.finfo(want.dtype).tiny)
            assert ((got.float() - want.float()).abs() <= ulp).all(), n
            assert (got == want).float().mean() > 0.99, n  # round to nearest, not truncation
        # atol: a few fp32 ulps of the update (~lr / (1 - beta1**7) = 0.02, ulp 1.9e-9) where it cancels the weight
        torch.testing.assert_close(st["master"].double(), want_p, rtol=2e-6, atol=1e-8)
        weight = p.detach().cpu()
        want_w = remainder.split(st["master"])[0] if rem else st["master"].bfloat16()
        assert torch.equal(_bits(weight), _bits(want_w)), n


def _step_all(part, entries, steps: int, seed: int = 2) -> None:
    gen = torch.Generator().manual_seed(seed)
    for i in range(steps):
        grads = {n: (torch.randn(p.shape, generator=gen) * 1e-2).bfloat16().to(p.device) for n, p, _ in entries}
        part.step(grads, HYPERS, 1 / 256 if i % 2 else 1.0, 0.9)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("moments", [FP32, BF16, FP16])
def test_remainder_bit_equal_to_the_fp32_master(device, moments, small_slices):
    """Five steps on the GPU part with the master as weight + remainder, and with it in fp32 (the fp32 GPU part
    itself for fp32 moments): masters, moments and counts bit-equal; weights the masters' split, which differs from
    the fp32 master's round-to-nearest-even weights only at exact ties. On CUDA both run torch's fused AdamW."""
    fp32_entries, rem_entries = _params(device, BF16), _params(device, BF16)
    if moments == FP32:
        wide = GpuPart(fp32_entries, kind="adam", n_groups=2)
    else:
        wide = NarrowGpuPart(fp32_entries, moment_dtypes=(moments, moments), remainders=False)
    thin = NarrowGpuPart(rem_entries, moment_dtypes=(moments, moments), remainders=True)
    _step_all(wide, fp32_entries, 5)
    _step_all(thin, rem_entries, 5)
    assert thin.held_bytes()["master_weights"] == 2 * sum(p.numel() for _, p, _ in rem_entries)
    for (n, pw, _), (_, pr, _) in zip(fp32_entries, rem_entries, strict=True):
        a, b = wide.export(n), thin.export(n)
        assert a["step"] == b["step"] == 5
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert b[k].dtype == (FP32 if k == "master" else moments)
            assert torch.equal(_bits(a[k]), _bits(b[k])), (n, k)
        assert torch.equal(_bits(pr.detach().cpu()), _bits(remainder.split(a["master"])[0])), n
        differ = _bits(pr.detach().cpu()) != _bits(pw.detach().cpu())
        assert ((_bits(a["master"]).to(torch.int64) & 0xFFFF) == 0x8000)[differ].all(), n


COMBOS = [(FP32, FP32, False), (BF16, BF16, False), (BF16, FP32, False), (FP32, FP32, True), (BF16, BF16, True)]
NAMES = {FP32: "fp32", BF16: "bf16", FP16: "fp16"}


def _config(fraction: float, m_dtype, v_dtype, rem: bool, half: bool = True, micro: int = 1) -> list[str]:
    shape = ["model.num_layers=3", "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
             "model.vocab_size=64", "train.micro_batch_size=2", f"train.global_batch_size={2 * micro}"]  # fmt: skip
    over = shape + (["train.precision=bf16", "train.params_dtype=half"] if half else [])
    if fraction > 0:
        over += [
            "optimizer.optimizer_cpu_offload=true",
            f"optimizer.optimizer_offload_fraction={fraction}",
            "optimizer.use_distributed_optimizer=true",
        ]
    if (m_dtype, v_dtype, rem) != (FP32, FP32, False):
        over += [
            "optimizer.use_precision_aware_optimizer=true",
            f"optimizer.exp_avg_dtype={NAMES[m_dtype]}",
            f"optimizer.exp_avg_sq_dtype={NAMES[v_dtype]}",
            f"optimizer.store_param_remainders={str(rem).lower()}",
        ]
    return over


@pytest.mark.parametrize("fraction", [0.0, 0.5])
@pytest.mark.parametrize(("m_dtype", "v_dtype", "rem", "half"),
                         [(*c, True) for c in COMBOS] + [(*c, False) for c in COMBOS if not c[2]])  # fmt: skip
def test_plan_bytes_equal_the_tensors_held(fraction, m_dtype, v_dtype, rem, half, small_slices):
    """The plan's GPU master_weights and optimizer_states (gpu_side.gpu_side_bytes, what evaluate calls) equal the
    bytes the built GPU part holds after a step, and its step staging the buffers that step allocated (bf16 and
    fp32 weights; the remainder form needs bf16 ones)."""
    from engine.build import build_model, build_optimizer
    from engine.config import load_config
    from engine.optim.param_groups import named_parameter_groups
    from engine.planning import plan

    cfg = load_config({}, overrides=_config(fraction, m_dtype, v_dtype, rem, half))
    model = build_model(cfg.model, torch.device("cpu"), 0, BF16 if half else FP32)
    opt = build_optimizer(named_parameter_groups(model, None, 0.0), cfg, model)
    opt.attach_model(model)
    train_losses(model, opt, batches(1, 1))
    narrow = (m_dtype, v_dtype, rem) != (FP32, FP32, False)
    assert isinstance(opt.gpu, NarrowGpuPart if narrow else GpuPart)
    held = opt.gpu.held_bytes()
    n_gpu = sum(p.numel() for p in opt.gpu.params.values())
    p = plan(cfg, gpu_budget_bytes=1 << 30, host_budget_bytes=1 << 30)
    assert p.parameters - p.cpu_parameters == n_gpu > 0
    for part in ("master_weights", "optimizer_states"):
        assert p.gpu.parts[part] == held[part], part
    stated = gpu_side_bytes(n_gpu, kind="adam", momentum=False, half_weights=half, main_grads=False,
                            moment_bytes=(m_dtype.itemsize, v_dtype.itemsize), remainders=rem)  # fmt: skip
    assert {k: stated[k] for k in held} == held
    if narrow:
        assert stated["optimizer_step_staging"] == opt.gpu.staging_bytes > 0
    opt.close()


@pytest.mark.parametrize(("saved", "loaded"), [((BF16, True), (FP32, False)), ((FP32, False), (BF16, True)),
                                               ((BF16, True), (BF16, True))])  # fmt: skip
def test_checkpoint_across_state_dtypes_at_fraction_0(saved, loaded, caplog):
    """All GPU-stepped: saved with one state form, loaded into another. Masters bit-equal, moments widened exactly
    or rounded to nearest with one line saying so, the weights as the loading form rounds its master; the same
    form resumes bit for bit."""
    model = tiny_gpt(dtype=BF16)
    opt = _opt(model, *saved)
    data = batches(5, 1)
    train_losses(model, opt, data[:3])
    state = opt.state_dict()
    resumed = tiny_gpt(seed=5, dtype=BF16)
    opt2 = _opt(resumed, *loaded)
    caplog.clear()
    with caplog.at_level("WARNING"):
        opt2.load_state_dict(state)
    said = [r.getMessage() for r in caplog.records if "exp_avg" in r.getMessage()]
    assert bool(said) == (saved[0] != loaded[0]), said
    back = opt2.state_dict()["state"]
    for n, st in state["state"].items():
        assert torch.equal(_bits(back[n]["master"]), _bits(st["master"])), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert back[n][k].dtype == loaded[0] and torch.equal(back[n][k], st[k].to(loaded[0])), (n, k)
        w = dict(resumed.named_parameters())[n].detach()
        want = remainder.split(st["master"])[0] if loaded[1] else st["master"].bfloat16()
        assert torch.equal(_bits(w), _bits(want)), n
    if saved == loaded:
        assert train_losses(model, opt, data[3:]) == train_losses(resumed, opt2, data[3:])
        for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
            assert torch.equal(_bits(a.detach()), _bits(b.detach()))
    opt.close()
    opt2.close()


def _opt(model, moments, rem: bool) -> HybridDeviceOptimizer:
    opt = HybridDeviceOptimizer(groups(model, 0.1, named=True), HybridOptions(
        **HP, exp_avg_dtype=moments, exp_avg_sq_dtype=moments, store_param_remainders=rem))  # fmt: skip
    opt.attach_model(model)
    return opt


def test_config_keys_act_at_fraction_0():
    """Without a CPU-stepped part the keys narrow the GPU-stepped part (they were refused there before); what still
    cannot combine is refused in one line naming the key."""
    from engine.build import build_optimizer
    from engine.config import ConfigError, load_config
    from engine.optim.param_groups import named_parameter_groups

    model = tiny_gpt(dtype=BF16)
    cfg = load_config({}, overrides=_config(0.0, BF16, FP32, True))
    opt = build_optimizer(named_parameter_groups(model, None, 0.0), cfg, model)
    opt._build()
    assert opt.cpu is None and isinstance(opt.gpu, NarrowGpuPart)
    assert {m.dtype for m in opt.gpu.m.values()} == {BF16} and {v.dtype for v in opt.gpu.v.values()} == {FP32}
    assert set(opt.gpu.rem) == set(opt.gpu.params) and not opt.gpu.master
    opt.close()
    for extra, key in ((["optimizer.optimizer=sgd"], "optimizer.exp_avg_dtype"),
                       (["optimizer.use_precision_aware_optimizer=false"], "optimizer.store_param_remainders"),
                       (["optimizer.delayed_param_update=true"], "optimizer.delayed_param_update")):  # fmt: skip
        with pytest.raises(ConfigError) as e:
            load_config({}, overrides=_config(0.0, BF16, FP32, True) + extra)
        lines = str(e.value).strip().splitlines()  # one line a problem, each naming its key and the fix
        assert any(line.startswith(key) for line in lines) and all("set " in line for line in lines), lines


def test_the_step_price_counts_the_bytes_the_narrow_pass_moves():
    """The step-time model prices the GPU part's step by the bytes per parameter its mechanism states: the one-pass
    narrow step (bf16 weight, remainder and moments read and written, the bf16 gradient read) moves fewer than the
    fp32 one's 32."""
    from engine.config import load_config
    from engine.optim.gpu_side import FP32_STEP_BYTES, gpu_step_bytes
    from engine.planning import plan

    budgets = {"gpu_budget_bytes": 1 << 30, "host_budget_bytes": 1 << 30}
    combos = ((FP32, FP32, False), (BF16, BF16, True))
    times = [plan(load_config({}, overrides=_config(0.0, *c)), **budgets).step_time.gpu_step_s for c in combos]
    narrow = gpu_step_bytes(kind="adam", half_weights=True, grad_bytes=2, moment_bytes=(2, 2), remainders=True)
    assert narrow == 2 * (2 + 2 + 2 + 2) + 2 < FP32_STEP_BYTES  # weight, remainder, m, v each way; the gradient
    assert times[1] / times[0] == pytest.approx(narrow / FP32_STEP_BYTES, rel=1e-12)


def test_a_moment_dtype_not_built_here_is_refused_in_one_line():
    from engine.optim.gpu_side import gpu_part

    with pytest.raises(ValueError, match=r"^exp_avg_dtype \(optimizer.exp_avg_dtype\)=torch.float64 is not built on "
                       r"the GPU-stepped part .*: use one of them"):  # fmt: skip
        gpu_part(_params("cpu", BF16), kind="adam", n_groups=2, moment_dtypes=(torch.float64, BF16))


def test_gpu_refusal_names_the_narrower_states_that_fit_without_a_cpu_part():
    """All GPU-stepped (no host to spare): the GPU refusal names the narrower states that fit there, which now
    narrow the GPU-stepped part, and the largest model at the current ones."""
    from dataclasses import replace

    from engine.config import load_config
    from engine.planning import planner
    from engine.planning.preflight import refusal
    from engine.resources import config_file

    gib = 1 << 30
    over = ["optimizer.optimizer_cpu_offload=false", "optimizer.optimizer_offload_fraction=0", "model.num_layers=24",
            "model.cpu_offloading_num_layers=0", "optimizer.overlap_cpu_optimizer_d2h_h2d=false"]  # fmt: skip
    p = planner(load_config(config_file("13b-h200.json"), overrides=over), gpu_budget_bytes=139 * gib,
                host_budget_bytes=10 * gib)  # fmt: skip
    wide = p.evaluate(0.0, 0)
    thin = p.evaluate(0.0, 0, replace(p.settings, remainders=True))
    assert not wide.gpu.fits and thin.fits
    said = refusal(p, wide)
    assert said.startswith("GPU memory: plan needs ") and "\n" not in said, said
    assert (f"; set optimizer.use_precision_aware_optimizer=true optimizer.store_param_remainders=true "
            f"(GPU {thin.gpu.total_bytes / gib:.1f} GiB); at the current state dtypes, ") in said, said  # fmt: skip


def test_delayed_update_leaves_the_narrow_gpu_part_exact():
    """With the delayed update (the CPU-stepped part's weights land a step late) and bf16 moments on both parts,
    given gradients: every master and moment equals the run without the delay, bit for bit; the GPU-stepped
    weights too (only the CPU-stepped ones lag)."""
    runs = []
    for delayed in (False, True):
        model = tiny_gpt(dtype=BF16)
        opt = HybridDeviceOptimizer(groups(model, 0.1, named=True), HybridOptions(
            **HP, offload_fraction=0.5, overlap_cpu_optimizer_d2h_h2d=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16,
            delayed_param_update=delayed, delayed_param_update_warmup=1))  # fmt: skip
        opt.attach_model(model)
        gen = torch.Generator().manual_seed(3)
        for _ in range(4):
            opt.zero_grad(set_to_none=True)
            for p in model.parameters():
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(BF16)
            assert opt.clip_and_step(1.0)[1]
        assert isinstance(opt.gpu, NarrowGpuPart) and opt.last_step_delayed is delayed
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if n not in opt.cpu_names}
        runs.append((opt.state_dict()["state"], weights))
        opt.close()
    (exact, w_exact), (late, w_late) = runs
    for n, st in exact.items():
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(st[k]), _bits(late[n][k])), (n, k)
    assert w_exact.keys() == w_late.keys() and all(torch.equal(w_exact[n], w_late[n]) for n in w_exact)
