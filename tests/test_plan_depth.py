"""The plan at great depth: "auto" evaluates O(log num_layers) plans, and chooses what trying every setting
would choose."""

from __future__ import annotations

import math

import pytest

import engine.planning.auto as auto
from engine.config import load_config
from engine.planning import planner, resolve
from engine.planning.auto import STEPS, NothingFits

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
    predicted step time among the fitting plans (within 1% a tie: fewer layers, then the least fraction); None
    when nothing fits."""
    fitting = []
    for k in range(p.max_layers() + 1):
        q = next((q for i in range(STEPS + 1) if (q := p.evaluate(i / STEPS, k)).gpu.fits), None)
        if q is not None and q.fits:
            fitting.append((p.pricer.price(q).total_s, k, q))
    if not fitting:
        return None
    fastest = min(t for t, _, _ in fitting)
    return min((x for x in fitting if x[0] <= fastest * 1.01), key=lambda x: (x[1], x[2].fraction))[2]


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


# --- the census per distinct layer shape, the plan over counts ---------------------------------------------------


def per_layer_census(cfg, cuda: bool):
    """The reference: the built-in GPT built at full depth, every layer a run of its own (no counts)."""
    import torch

    from engine.build import gpt_shape
    from engine.models.gpt import GPT
    from engine.optim.partition import forward_order
    from engine.planning.census import Census, _groups, _layer_index, _training_bytes, builtin_census
    from engine.planning.runs import runs_of

    with torch.device("meta"):
        model = GPT(**gpt_shape(cfg.model))
    named = dict((n, p) for n, p in model.named_parameters())
    order = forward_order(list(named))
    half = cfg.train.params_dtype == "half"
    runs = runs_of([(n, named[n].numel()) for n in order], _groups(order, {n: _layer_index(n) for n in order}),
                   compress=False)  # fmt: skip
    counted = builtin_census(cfg, cuda=cuda)
    return Census(
        runs=runs,
        n_layers=cfg.model.num_layers,
        activations=counted.activations,
        builtin=True,
        weight_bytes=sum(_training_bytes(x, half) for x in [*model.parameters(), *model.buffers()]),
    )


def test_the_census_builds_one_layer_per_distinct_shape(monkeypatch):
    from engine.models import gpt
    from engine.planning.census import builtin_census

    built = [0]
    real = gpt.TransformerLayer.__init__

    def counting(self, *args, **kwargs):
        built[0] += 1
        real(self, *args, **kwargs)

    monkeypatch.setattr(gpt.TransformerLayer, "__init__", counting)
    census = builtin_census(deep_cfg(100_000), cuda=True)
    assert built[0] <= 2  # not 100,000
    assert [r.count for r in census.runs] == [1, 100_000, 1]
    small = deep_cfg(7)
    counted, reference = builtin_census(small, cuda=True), per_layer_census(small, cuda=True)
    assert counted.expanded() == reference.expanded()
    assert counted.weight_bytes == reference.weight_bytes and counted.parameters == reference.parameters


@pytest.mark.parametrize(
    "extra",
    [{}, {"model": {"cpu_offloading_double_buffering": True}},
     {"model": {"cpu_offloading": False, "cpu_offloading_num_layers": 0, "recompute_granularity": "full",
                "recompute_num_layers": 3}},
     {"model": {"cpu_offloading": False, "cpu_offloading_num_layers": 0, "fine_grained_activation_offloading": True,
                "offload_modules": ["mlp"]}},
     {"optimizer": {"overlap_cpu_optimizer_d2h_h2d": False, "cpu_offload_gpu_assist": False}, "world": 2}],
)  # fmt: skip
def test_the_plan_over_counts_equals_the_plan_layer_by_layer(extra):
    """Identical layers counted once (closed forms over runs, the backward's worst layer among the points where
    a per-layer figure changes) give the plan of the same model listed layer by layer, byte for byte."""
    from engine.planning.auto import Planner
    from engine.planning.memory import settings_of

    world = extra.pop("world", 1)
    base = {"model": {"num_layers": 9, "hidden_size": 96, "num_attention_heads": 4, "seq_length": 300,
                      "cpu_offloading": True, "cpu_offloading_num_layers": 1},
            "train": {"micro_batch_size": 2, "global_batch_size": 8 * world, "params_dtype": "half",
                      "precision": "bf16"},
            "optimizer": {"optimizer_cpu_offload": True, "use_distributed_optimizer": True,
                          "overlap_cpu_optimizer_d2h_h2d": True, "cpu_offload_gpu_assist": True}}  # fmt: skip
    for section, values in extra.items():
        base[section] = {**base[section], **values}
    cfg = load_config(base)
    for cuda in (True, False):
        counted = planner(cfg, gpu_budget_bytes=GIB if cuda else None, host_budget_bytes=GIB,
                          device="cuda" if cuda else "cpu", data_parallel_size=world)  # fmt: skip
        listed = Planner(cfg, per_layer_census(cfg, cuda), settings_of(cfg, world), cuda=cuda,
                         gpu_budget=counted.gpu_budget, host_budget=GIB)  # fmt: skip
        assert [r.count for r in listed.census.runs].count(1) == len(listed.census.runs)
        for fraction in (0.0, 0.07, 0.5, 0.93, 1.0):
            for k in range(9):
                assert counted.evaluate(fraction, k).to_json() == listed.evaluate(fraction, k).to_json()


def test_offload_count_follows_the_parameter_by_parameter_rule():
    import random

    from engine.optim.partition import offload_count

    def one_by_one(numels, fraction):  # the rule as the split states it, parameter by parameter
        target, acc, taken = fraction * sum(numels), 0, 0
        for n in reversed(numels):
            if acc >= target or acc + n - target > target - acc:
                break
            acc, taken = acc + n, taken + 1
        return taken

    rng = random.Random(0)
    for _ in range(300):
        runs = [(tuple(rng.randint(1, 50) for _ in range(rng.randint(1, 4))), rng.randint(1, 30))
                for _ in range(rng.randint(1, 4))]  # fmt: skip
        numels = [n for t, c in runs for _ in range(c) for n in t]
        for fraction in (0.0, rng.random(), 0.5, 1.0):
            assert offload_count(runs, fraction) == one_by_one(numels, fraction)


def test_plan_at_100000_layers_answers():
    """`--plan` of a 100,000-layer model answers (it used to run for minutes): the 13 B shape names the
    largest depth that fits; the default config prints its plan."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    train = [sys.executable, str(root / "bin" / "train")]
    args = [
        "configs/13b-h200.json",
        "model.num_layers=100000",
        "--plan",
        "--gpu-memory",
        "139.2",
        "--host-memory",
        "125",
    ]
    deep = subprocess.run([*train, *args], cwd=root, capture_output=True, text=True, timeout=300)
    assert deep.returncode == 2 and "99999 offloaded layers" in deep.stderr + deep.stdout
    assert "at most 46 layers (14.5 B parameters) fit" in deep.stderr + deep.stdout
    default = subprocess.run([*train, "configs/default.json", "model.num_layers=100000", "--plan"], cwd=root,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "memory plan: 19.83 B parameters" in default.stdout, default.stdout + default.stderr


def test_initialize_says_so_before_building_a_deep_gpt(monkeypatch, capsys, make_engine):
    import engine.engine

    monkeypatch.setattr(engine.engine, "DEEP_LAYERS", 2)
    make_engine()
    assert "building the GPT: 2 layers" in capsys.readouterr().out
