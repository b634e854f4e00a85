"""The step-time model "auto" minimises (engine.planning.step_time), on crafted rates and workloads."""

from __future__ import annotations

import dataclasses

import pytest

from engine.planning.step_time import GPU_STEP_BYTES, Costs, Mix, Schedule, Workload, default_costs, step_time

# round figures: 1 TFLOP/s, 1 GB/s each way, 1 G params/s, 1 TB/s
COSTS = Costs(1e9, 1e9, 1e9, 1e12, 1e12, "test")
# 4 layers of 1 TFLOP forward each, 2 TFLOP outside them: a micro-batch's forward is 6 s, backward 12 s
WORK = Workload.of_layers(2, [1e12] * 4, 2e12)
EXACT = Schedule(cpu_offload=True, overlap=True, delayed=False, grad_bytes=2, weight_bytes=2)


def mix(k=0, r=0, cpu=0, gpu=10**9, moved=0):
    return Mix(fraction=0.0, offloaded_layers=k, recomputed_layers=r, cpu_parameters=cpu, gpu_parameters=gpu,
               offloaded_bytes=moved)  # fmt: skip


def test_workload_sums_layers_in_order():
    w = Workload.of_layers(1, [1.0, 2.0, 4.0, 8.0], 0.5)
    assert w.n_layers == 4 and w.forward_flops == 15.5
    assert [w.layers_flops(a, b) for a, b in [(0, 1), (1, 3), (2, 4), (3, 9), (4, 6), (2, 2)]] == [1, 6, 12, 8, 0, 0]


def test_nothing_offloaded_is_compute_and_the_gpu_step():
    t = step_time(WORK, mix(), EXACT, COSTS)
    assert t.compute_s == pytest.approx(2 * 18)  # 2 micro-batches x (6 + 12) s
    assert t.gpu_step_s == pytest.approx(1e9 * GPU_STEP_BYTES / 1e12)
    assert (t.activation_copies_s, t.recompute_s, t.cpu_step_s, t.cpu_exposed_s) == (0, 0, 0, 0)
    assert t.total_s == pytest.approx(36 + 0.032)


def test_activation_copies_show_only_beyond_compute():
    hidden = step_time(WORK, mix(k=1, moved=5 * 10**9), EXACT, COSTS)  # 5 s of copies under 6 s and 12 s
    assert hidden.activation_copies_s == 0
    exposed = step_time(WORK, mix(k=3, moved=20 * 10**9), EXACT, COSTS)  # 20 s each way: 14 s + 8 s shown
    assert exposed.activation_copies_s == pytest.approx(2 * (14 + 8))
    slower_link = step_time(WORK, mix(k=1, moved=5 * 10**9), EXACT, Costs(0.5e9, 1e9, 1e9, 1e12, 1e12, "t"))
    assert slower_link.activation_copies_s == pytest.approx(2 * (10 - 6))  # D2H only: 10 s under a 6 s forward
    slow_reload = step_time(WORK, mix(k=1, moved=5 * 10**9), EXACT, Costs(1e9, 0.25e9, 1e9, 1e12, 1e12, "t"))
    assert slow_reload.activation_copies_s == pytest.approx(2 * (20 - 12))  # H2D only: 20 s under a 12 s backward


def test_covered_copies_show_their_stated_share():
    shared = dataclasses.replace(COSTS, copy_share_under_compute=0.2)
    covered = step_time(WORK, mix(k=1, moved=5 * 10**9), EXACT, shared)  # 5 s each way under 6 s and 12 s
    assert covered.activation_copies_s == pytest.approx(2 * (0.2 * 5 + 0.2 * 5))
    # where the link binds the copies' own time stands (20 s > 6 + 4 s and > 12 + 4 s), not compute + share
    bound = step_time(WORK, mix(k=3, moved=20 * 10**9), EXACT, shared)
    assert bound.activation_copies_s == pytest.approx(2 * (14 + 8))
    assert default_costs(cuda=True, precision="bf16").copy_share_under_compute == 0.2


def test_recompute_adds_the_layers_forward_and_covers_reloads():
    t = step_time(WORK, mix(k=1, r=2), EXACT, COSTS)
    assert t.recompute_s == pytest.approx(2 * 2)  # layers 1 and 2, once per micro-batch
    # 12.5 s of copies: 6.5 s beyond the 6 s forward, 0.5 s beyond a 12 s backward alone, none beyond 12 + 1 s
    assert step_time(WORK, mix(k=1, moved=12.5e9), EXACT, COSTS).activation_copies_s == pytest.approx(2 * 7)
    assert step_time(WORK, mix(k=1, r=1, moved=12.5e9), EXACT, COSTS).activation_copies_s == pytest.approx(2 * 6.5)
    t = step_time(WORK, mix(k=3, r=5), EXACT, COSTS)  # only one layer is left to recompute
    assert t.recompute_s == pytest.approx(2 * 1)


def test_the_schedule_decides_what_the_cpu_step_hides():
    m = mix(cpu=3 * 10**9, gpu=1 * 10**9)  # a 3 s CPU step, a 32 ms GPU step
    exact = step_time(WORK, m, EXACT, COSTS)
    # exact: hidden by the GPU step and the forward of the GPU-stepped quarter of one micro-batch (6 s x 1/4)
    assert exact.cpu_step_s == pytest.approx(3)
    assert exact.cpu_exposed_s == pytest.approx(3 - 0.032 - 1.5)
    delayed = step_time(WORK, m, Schedule(True, True, True, 2, 2), COSTS)
    assert delayed.cpu_exposed_s == 0  # hidden by the next step's 36 s of GPU work
    huge = mix(cpu=40 * 10**9, gpu=10**9)
    assert step_time(WORK, huge, Schedule(True, True, True, 2, 2), COSTS).cpu_exposed_s == pytest.approx(4 - 0.032)
    serial = step_time(WORK, m, Schedule(True, False, False, 4, 2), COSTS)
    assert serial.cpu_exposed_s == pytest.approx(3 + 3 * (4 + 2))  # and the copies: 12 GB down, 6 GB up
    off = step_time(WORK, m, Schedule(False, False, False, 2, 2), COSTS)
    assert off.cpu_step_s == off.cpu_exposed_s == 0


def test_default_costs_are_stated_and_described():
    h200 = default_costs(cuda=True, precision="bf16")
    assert h200.pcie_d2h_bytes_per_s == 55e9 and h200.cpu_params_per_s == 4e9 and h200.flops_per_s == 550e12
    assert default_costs(cuda=True, precision="fp32").flops_per_s < h200.flops_per_s
    assert h200.describe() == ("rates: PCIe 55.0/55.0 GB/s stated, CPU AdamW 4.0 G params/s stated, GPU 550 TFLOP/s "
                               "stated (stated H200 defaults)")  # fmt: skip
    assert default_costs(cuda=False, precision="bf16").source == "stated CPU defaults"
