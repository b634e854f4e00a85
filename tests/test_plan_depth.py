"""The plan at great depth: "auto" evaluates O(log num_layers) plans, and chooses what trying every setting
would choose."""

from __future__ import annotations

import math

import pytest

import engine.planning.auto as auto
from engine.config import load_config
from engine.planning import planner, resolve
from engine.planning.auto import STEPS, NothingFits, added_seconds

GIB = 1 << 30


def deep_cfg(layers: int, double_buffering: bool = False, fraction: str | float = "auto", seq: int = 4096):
    return load_config({
        "model": {"num_layers": layers, "hidden_size": 64, "num_attention_heads": 4, "seq_length": seq,
                  "cpu_offloading": True, "cpu_offloading_num_layers": "auto",
                  "cpu_offloading_double_buffering": double_buffering},
        "train": {"micro_batch_size": 1, "global_batch_size": 8, "params_dtype": "half", "precision": "bf16"},
        "optimizer": {"optimizer_cpu_offload": True, "use_distributed_optimizer": True,
                      "overlap_cpu_optimizer_d2h_h2d": True, "optimizer_offload_fraction": fraction},
    })  # fmt: skip


def gpu_bounds(cfg) -> tuple[int, int]:
    """(the least GPU bytes any setting reaches, the GPU bytes with nothing offloaded)."""
    p = planner(cfg, gpu_budget_bytes=GIB, host_budget_bytes=GIB)
    return p.evaluate(1.0, p.max_layers()).gpu.total_bytes, p.evaluate(0.0, 0).gpu.total_bytes


def exhaustive(p):
    """What "auto" means, by trying every layer count, each at its smallest fitting grid fraction: the least
    added time per step among the fitting plans (ties: fewer layers); None when nothing fits."""
    best = None
    for k in range(p.max_layers() + 1):
        q = next((q for i in range(STEPS + 1) if (q := p.evaluate(i / STEPS, k)).gpu.fits), None)
        if q is not None and q.fits:
            cost = added_seconds(q, p.settings)
            if best is None or cost < best[0] - 1e-9:
                best = (cost, q)
    return None if best is None else best[1]


@pytest.mark.parametrize("double_buffering", [False, True])
def test_auto_chooses_what_trying_every_setting_chooses(double_buffering):
    cfg = deep_cfg(12, double_buffering, seq=1024)
    least, most = gpu_bounds(cfg)
    chosen = []
    for gpu in [least - 1, least, least + (most - least) // 50, (least + most) // 2, most]:
        for host in [GIB // 2, 100 * GIB]:
            p = planner(cfg, gpu_budget_bytes=gpu, host_budget_bytes=host)
            want = exhaustive(p)
            if want is None:
                with pytest.raises(NothingFits):
                    resolve(p)
                continue
            got = resolve(p)
            assert (got.fraction, got.offloaded_layers) == (want.fraction, want.offloaded_layers)
            assert got.gpu.total_bytes == want.gpu.total_bytes and got.host.total_bytes == want.host.total_bytes
            chosen.append((got.fraction, got.offloaded_layers))
    assert len(set(chosen)) >= 3  # the budgets lead to different choices: the comparison says something


def count_evaluations(monkeypatch, cfg, gpu: int) -> int:
    calls = [0]
    real = auto.evaluate

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(auto, "evaluate", counting)
    try:
        resolve(planner(cfg, gpu_budget_bytes=gpu, host_budget_bytes=100 * GIB))
    except NothingFits:
        pass
    monkeypatch.setattr(auto, "evaluate", real)
    return calls[0]


@pytest.mark.parametrize("where", ["nothing fits", "tight", "roomy"])
def test_auto_evaluates_a_logarithmic_number_of_plans(monkeypatch, where):
    """Trying every layer count made `--plan` at 10,000 layers take minutes; bisection evaluates O(log layers)
    plans per fraction step (nothing fits: the largest depth that would is bisected too, O(log^2))."""
    counts = {}
    for layers in (32, 512):
        cfg = deep_cfg(layers)
        least, most = gpu_bounds(cfg)
        gpu = {"nothing fits": least - 1, "tight": least + (most - least) // 50, "roomy": (least + most) // 2}[where]
        counts[layers] = count_evaluations(monkeypatch, cfg, gpu)
    bound = 16 * math.log2(512) ** (2 if where == "nothing fits" else 1)
    assert counts[512] <= bound, counts
    assert counts[512] < 512  # fewer plans than layers
