"""The rates "auto" prices with: measured where the run trains (engine.planning.rates), given by the config's plan
section, else stated; the plan prices with the rates it measured and says which were measured, given or stated.

The CPU AdamW rate is measured here for real (the engine's own pass, on this CPU); the GPU's copies and matmul
need CUDA, so where a test needs them measured their functions are replaced by fixed figures."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.config import load_config
from engine.optim import cpu_arith
from engine.planning import format_plan, planner, rates, resolve
from engine.planning.memory import settings_of
from engine.planning.step_time import Costs

GIB = 1 << 30
FAST, SLOW = 1e15, 1e3
OFFLOAD = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5, "use_distributed_optimizer": True}


def cfg(**plan):
    return load_config({
        "model": {"num_layers": 12, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 1024,
                  "cpu_offloading": True, "cpu_offloading_num_layers": "auto"},
        "train": {"micro_batch_size": 1, "global_batch_size": 8, "params_dtype": "half", "precision": "bf16"},
        "optimizer": {"optimizer_cpu_offload": True, "overlap_cpu_optimizer_d2h_h2d": True,
                      "use_distributed_optimizer": True, "optimizer_offload_fraction": "auto"},
        "plan": plan,
    })  # fmt: skip


def both_routes_fit(c) -> int:
    """A GPU budget met by the whole fraction without offloaded layers, and by offloaded layers at fraction 0."""
    p = planner(c, gpu_budget_bytes=GIB, host_budget_bytes=100 * GIB)
    return p.evaluate(1.0, 0).gpu.total_bytes


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device as far as the rates go: its copies and matmul measure `figures` (the CPU AdamW rate too)."""
    figures = {}
    monkeypatch.setattr(rates, "cuda_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(rates, "pcie_rates", lambda device: (figures["d2h"], figures["h2d"]))
    monkeypatch.setattr(rates, "matmul_rate", lambda device, hidden, dtype: figures["flops"])
    monkeypatch.setattr(rates, "cpu_adam_rate", lambda *form: figures["cpu"])
    return figures


def measured_plan(c, **kw):
    p = planner(c, gpu_budget_bytes=both_routes_fit(c), host_budget_bytes=100 * GIB, measure_rates=True, **kw)
    return p, resolve(p)


def test_the_plan_prices_with_the_rates_it_measured(fake_gpu):
    c = cfg()
    choices = []
    for d2h, h2d, cpu in ((FAST, FAST, SLOW), (SLOW, SLOW, FAST)):  # copies free / the CPU step free
        fake_gpu.update(d2h=d2h, h2d=h2d, cpu=cpu, flops=1e12)
        p, got = measured_plan(c)
        given = Costs(
            d2h,
            h2d,
            cpu,
            1e12,
            p.pricer.costs.hbm_bytes_per_s,
            "test",
            copy_share_under_compute=p.pricer.costs.copy_share_under_compute,
        )
        same = resolve(planner(c, gpu_budget_bytes=both_routes_fit(c), host_budget_bytes=100 * GIB, costs=given))
        assert (got.fraction, got.offloaded_layers, got.step_time) == (same.fraction, same.offloaded_layers,
                                                                       same.step_time)  # fmt: skip
        assert p.pricer.costs.measured == {"pcie_d2h_bytes_per_s", "pcie_h2d_bytes_per_s", "cpu_params_per_s",
                                           "flops_per_s"}  # fmt: skip
        choices.append((got.fraction, got.offloaded_layers))
    (f_copies, k_copies), (f_cpu, k_cpu) = choices
    assert f_copies == 0.0 and k_copies > 0  # copies measured free: offloaded layers, no CPU step
    assert k_cpu == 0 and f_cpu > 0.0  # the CPU step measured free: the fraction, no copies


def test_the_plan_says_which_rates_were_measured(fake_gpu):
    fake_gpu.update(d2h=53.1e9, h2d=54.8e9, cpu=4.4e9, flops=612e12)
    _, got = measured_plan(cfg())
    line = "rates: PCIe 53.1/54.8 GB/s measured, CPU AdamW 4.4 G params/s measured, GPU 612 TFLOP/s measured"
    assert got.costs == line and line in format_plan(got)
    js = json.loads(json.dumps(got.to_json()))["predicted_step"]["rates"]
    assert js["measured"] == ["cpu_adam_g_params_per_s", "gpu_tflops", "pcie_d2h_gb_per_s", "pcie_h2d_gb_per_s"]
    assert (js["pcie_d2h_gb_per_s"], js["cpu_adam_g_params_per_s"], js["gpu_tflops"]) == (53.1, 4.4, 612.0)


def test_a_given_rate_is_used_and_not_measured(fake_gpu):
    fake_gpu.update(d2h=53.1e9, h2d=54.8e9, cpu=4.4e9, flops=612e12)
    p, got = measured_plan(cfg(cpu_adam_g_params_per_s=2.5, gpu_tflops=700))
    c = p.pricer.costs
    assert (c.cpu_params_per_s, c.flops_per_s, c.pcie_d2h_bytes_per_s) == (2.5e9, 700e12, 53.1e9)
    assert c.given == {"cpu_params_per_s", "flops_per_s"} and c.measured == {"pcie_d2h_bytes_per_s",
                                                                             "pcie_h2d_bytes_per_s"}  # fmt: skip
    assert "CPU AdamW 2.5 G params/s given, GPU 700 TFLOP/s given" in got.costs
    # given rates price a plan for another machine too (nothing measured there)
    other = planner(cfg(pcie_d2h_gb_per_s=20, pcie_h2d_gb_per_s=25), gpu_budget_bytes=GIB, host_budget_bytes=GIB)
    assert other.pricer.costs.measured == set() and other.pricer.costs.given == {"pcie_d2h_bytes_per_s",
                                                                                 "pcie_h2d_bytes_per_s"}  # fmt: skip
    assert "PCIe 20.0/25.0 GB/s given" in other.pricer.costs.describe()


@pytest.mark.parametrize(
    ("measure_rates", "here", "measured"),
    [(None, True, True), (None, False, False), (True, False, True), (False, True, False)],
)
def test_when_the_rates_are_measured(fake_gpu, measure_rates, here, measured):
    """null: a plan for a run here (not bin/train --plan --gpu-memory); true: always; false: never."""
    fake_gpu.update(d2h=1e9, h2d=1e9, cpu=1e9, flops=1e12)
    c = cfg(measure_rates=measure_rates)
    got = rates.for_plan(c, settings_of(c), None, here=here)
    assert (got is not None and got.measured == set(rates.matters(c, settings_of(c)))) == measured
    budgeted = planner(c, gpu_budget_bytes=GIB, host_budget_bytes=GIB)  # --plan --gpu-memory: not here
    assert bool(budgeted.pricer.costs.measured) == (measure_rates is True)


def test_only_the_rates_that_matter_are_measured(fake_gpu):
    """Without offload only the matmul matters; the CPU rate only for the engine's own CPU AdamW."""
    fake_gpu.update(d2h=1e9, h2d=1e9, cpu=1e9, flops=1e12)
    plain = load_config({"model": {"num_layers": 2, "hidden_size": 64}})
    assert rates.for_plan(plain, settings_of(plain), None, here=True).measured == {"flops_per_s"}
    torch_cpu = load_config({"optimizer": {**OFFLOAD, "use_torch_optimizer_for_cpu_offload": True}})
    got = rates.for_plan(torch_cpu, settings_of(torch_cpu), None, here=True)
    assert got.measured == {"flops_per_s", "pcie_d2h_bytes_per_s", "pcie_h2d_bytes_per_s"}


def test_a_cpu_machine_prices_with_the_stated_rates():
    assert not torch.cuda.is_available()  # this test's machine
    c = cfg()
    costs = planner(c, device="cuda", host_budget_bytes=100 * GIB).pricer.costs
    assert costs.measured == set() and costs.source == "stated H200 defaults"
    assert rates.for_plan(c, settings_of(c), None, here=True) is None


def test_the_cpu_step_is_measured_in_the_form_the_run_steps(monkeypatch):
    """cpu_form reads the form from the config; step_rate steps it through FusedAdamW (the engine's pass), and the
    rate is the parameters over the median step."""
    narrow = load_config({"train": {"params_dtype": "half", "precision": "bf16"},
                          "optimizer": {**OFFLOAD, "use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16",
                                        "exp_avg_sq_dtype": "bf16", "store_param_remainders": True,
                                        "cpu_optimizer_threads": 3}})  # fmt: skip
    bf16, f32 = torch.bfloat16, torch.float32
    assert rates.cpu_form(narrow, settings_of(narrow)) == (3, bf16, bf16, bf16, None, True, False)
    wide = load_config({"train": {"params_dtype": "half", "precision": "bf16", "global_batch_size": 16},
                        "optimizer": {**OFFLOAD, "accumulate_allreduce_grads_in_fp32": True,
                                      "cpu_optimizer_threads": 2}})  # fmt: skip
    assert rates.cpu_form(wide, settings_of(wide)) == (2, f32, f32, f32, bf16, False, False)

    seen = []
    original = cpu_arith.FusedAdamW.step
    monkeypatch.setattr(cpu_arith.FusedAdamW, "step", lambda self, steps: (seen.append(steps), original(self, steps)))
    ticks = iter([0.0, 1.0, 1.0, 4.0, 4.0, 6.0])  # steps of 1, 3 and 2 seconds: the median is 2
    monkeypatch.setattr(cpu_arith.time, "perf_counter", lambda: next(ticks))
    numel = 1 << 17
    rate = cpu_arith.step_rate(numel, 2, moments=(bf16, bf16), grad=bf16, half=None, remainders=True, reps=3)
    assert rate == numel / 2.0
    assert len(seen) == 4  # one warm-up and three timed
    (s,) = seen[0]
    assert (s.m.dtype, s.v.dtype, s.g.dtype, s.p.dtype, s.rem.dtype, s.in_place) == (bf16, bf16, bf16, bf16,
                                                                                      torch.int16, True)  # fmt: skip


def test_the_cpu_adamw_and_matmul_rates_measure_on_a_cpu():
    bf16 = torch.bfloat16
    for form in ((torch.float32, torch.float32, bf16, bf16, False), (bf16, bf16, bf16, None, True)):
        rate = rates.cpu_adam_rate(2, *form, False, numel=1 << 18)
        assert math.isfinite(rate) and rate > 0
    flops = rates.matmul_rate("cpu", 64, torch.float32, rows=256, reps=3)
    assert math.isfinite(flops) and flops > 0
