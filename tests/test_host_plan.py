"""host_plan: the CPU part's host bytes by part, against hand-computed figures."""

from __future__ import annotations

import pytest

from engine.optim.host_plan import cpu_side_host_bytes, speculation_units

MIB = 1 << 20


def test_adam_bf16_overlap_hand_computed():
    # three layer units of 1000 elements and an output unit of 1500 (forward order), bf16 weights,
    # fp32 gradients shipped (accumulated in fp32), a bound that holds two spares of 14 B/element
    units = [1000, 1000, 1000, 1500]
    got = cpu_side_host_bytes(units, kind="adam", use_torch=False, half_bytes=2, grad_bytes=4, speculate=True,
                              speculation_buffer_bytes=14 * 2500)  # fmt: skip
    assert got == {
        "master": 4 * 4500,
        "exp_avg": 4 * 4500,
        "exp_avg_sq": 4 * 4500,
        "grad_staging": 4 * 4500,
        "grad_scratch": 0,
        "weight_staging": 2 * 2 * 1500,  # two ring buffers of the largest unit
        "speculation": 14 * (1500 + 1000),  # the output unit and the last layer, backward order
    }


def test_fp32_weights_no_overlap():
    got = cpu_side_host_bytes([10, 20], kind="adam", use_torch=False, half_bytes=0, grad_bytes=4, speculate=False,
                              speculation_buffer_bytes=2048 * MIB)  # fmt: skip
    assert got == {"master": 120, "exp_avg": 120, "exp_avg_sq": 120, "grad_staging": 120, "grad_scratch": 0,
                   "weight_staging": 0, "speculation": 0}  # fmt: skip


def test_torch_optimizer_and_sgd_never_speculate():
    adam = cpu_side_host_bytes([8, 4], kind="adam", use_torch=True, half_bytes=2, grad_bytes=2, speculate=True,
                               speculation_buffer_bytes=2048 * MIB)  # fmt: skip
    assert adam["speculation"] == 0 and adam["grad_scratch"] == 4 * 8 and adam["grad_staging"] == 2 * 12
    sgd = cpu_side_host_bytes([8, 4], kind="sgd", use_torch=False, half_bytes=2, grad_bytes=2, speculate=True,
                              speculation_buffer_bytes=2048 * MIB)  # fmt: skip
    assert sgd == {"master": 48, "momentum_buffer": 48, "grad_staging": 24, "grad_scratch": 32,
                   "weight_staging": 2 * 2 * 8, "speculation": 0}  # fmt: skip


def test_zero_bound_disables_speculation_and_one_unit_gets_one_ring_buffer():
    got = cpu_side_host_bytes([100], kind="adam", use_torch=False, half_bytes=2, grad_bytes=2, speculate=True,
                              speculation_buffer_bytes=0)  # fmt: skip
    assert got["speculation"] == 0 and got["weight_staging"] == 2 * 100


def test_spares_skip_units_that_do_not_fit():
    # backward order: 50 (fits), 300 (does not fit what is left), 40 (fits)
    assert speculation_units([40, 300, 50], 1, 100) == [2, 0]
    assert speculation_units([40, 300, 50], 1, 0) == []


def test_bound_does_not_grow_with_depth():
    per_layer = 12 * 4096 * 4096
    shallow, deep = ([per_layer] * n for n in (4, 40))
    kw = dict(kind="adam", use_torch=False, half_bytes=2, grad_bytes=4, speculate=True,
              speculation_buffer_bytes=2048 * MIB)  # fmt: skip
    a, b = cpu_side_host_bytes(shallow, **kw), cpu_side_host_bytes(deep, **kw)
    for part in ("weight_staging", "speculation", "grad_scratch"):
        assert a[part] == b[part] and b[part] <= 2048 * MIB + 2 * 2 * per_layer
    assert b["master"] + b["exp_avg"] + b["exp_avg_sq"] == 12 * 40 * per_layer


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind='lion'"):
        cpu_side_host_bytes([1], kind="lion", use_torch=False, half_bytes=0, grad_bytes=4, speculate=False,
                            speculation_buffer_bytes=0)  # fmt: skip
    with pytest.raises(ValueError, match="speculation_buffer_bytes=-1"):
        cpu_side_host_bytes([1], kind="adam", use_torch=False, half_bytes=0, grad_bytes=4, speculate=True,
                            speculation_buffer_bytes=-1)  # fmt: skip


def test_config_key_reaches_the_cpu_part():
    from optim_reference import tiny_gpt

    from engine.build import build_optimizer
    from engine.config import load_config
    from engine.optim.param_groups import named_parameter_groups

    model = tiny_gpt()
    for mb, spec in ((0, False), (1, True)):
        over = ["optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=0.5",
                "optimizer.use_distributed_optimizer=true", "optimizer.overlap_cpu_optimizer_d2h_h2d=true",
                f"optimizer.speculation_buffer_mb={mb}"]  # fmt: skip
        cfg = load_config({}, overrides=over)
        opt = build_optimizer(named_parameter_groups(model, None, 0.0), cfg, model)
        opt._build()
        assert opt.cpu.speculate is spec
        opt.close()
    assert load_config({}).optimizer.speculation_buffer_mb == 2048


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_bound(bad):
    from optim_reference import tiny_gpt

    from engine.optim import HybridDeviceOptimizer, HybridOptions

    with pytest.raises(ValueError, match=r"speculation_buffer_mb \(optimizer\.speculation_buffer_mb\)"):
        HybridDeviceOptimizer(tiny_gpt().named_parameters(), HybridOptions(lr=1e-3, speculation_buffer_mb=bad))
