"""The "auto" keys are chosen by predicted step time among the mixes that fit: crafted rates flip the choice,
the budgets are never exceeded, the runners-up are listed, recompute stays off the offloaded layers, and the
delayed update never gets fraction 0."""

from __future__ import annotations

import json

import pytest
import torch

from engine.build import build_model
from engine.config import load_config
from engine.planning import format_plan, planner, resolve
from engine.planning.auto import STEPS, NothingFits
from engine.planning.step_time import Costs

GIB = 1 << 30
FAST, SLOW = 1e15, 1e3
CHEAP_PCIE = Costs(FAST, FAST, SLOW, 1e12, 1e12, "test: copies free, CPU step slow")
CHEAP_CPU = Costs(SLOW, SLOW, FAST, 1e12, 1e12, "test: copies slow, CPU step free")


def cfg(*, delayed=False, recompute=False, layers="auto", fraction="auto"):
    return load_config({
        "model": {"num_layers": 12, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 1024,
                  "cpu_offloading": True, "cpu_offloading_num_layers": layers,
                  **({"recompute_granularity": "full", "recompute_num_layers": "auto"} if recompute else {})},
        "train": {"micro_batch_size": 1, "global_batch_size": 8, "params_dtype": "half", "precision": "bf16"},
        "optimizer": {"optimizer_cpu_offload": True, "overlap_cpu_optimizer_d2h_h2d": True,
                      "use_distributed_optimizer": True, "optimizer_offload_fraction": fraction,
                      "delayed_param_update": delayed,
                      **({"delayed_param_update_warmup": 0} if delayed else {})},
    })  # fmt: skip


def both_routes_fit(c) -> int:
    """A GPU budget met by the whole fraction without offloaded layers, and by offloaded layers at fraction 0."""
    p = planner(c, gpu_budget_bytes=GIB, host_budget_bytes=100 * GIB)
    budget = p.evaluate(1.0, 0).gpu.total_bytes
    assert p.evaluate(0.0, p.max_layers()).gpu.total_bytes <= budget  # layers alone reach it too
    return budget


def chosen(c, costs, gpu=None, host=100 * GIB):
    return resolve(planner(c, gpu_budget_bytes=gpu or both_routes_fit(c), host_budget_bytes=host, costs=costs))


def test_cheap_copies_choose_layers_and_a_cheap_cpu_chooses_the_fraction():
    c = cfg()
    by_copies, by_cpu = chosen(c, CHEAP_PCIE), chosen(c, CHEAP_CPU)
    assert by_copies.fraction == 0.0 and by_copies.offloaded_layers > 0
    assert by_cpu.offloaded_layers == 0 and by_cpu.fraction > 0.0
    assert by_copies.fits and by_cpu.fits


def test_the_choice_never_exceeds_a_budget_and_none_weighed_is_faster():
    c = cfg()
    p0 = planner(c, gpu_budget_bytes=GIB, host_budget_bytes=100 * GIB)
    least, most = p0.evaluate(1.0, p0.max_layers()).gpu.total_bytes, p0.evaluate(0.0, 0).gpu.total_bytes
    for costs in (CHEAP_PCIE, CHEAP_CPU, Costs(1e9, 2e9, 1e6, 1e10, 1e12, "t"), None):
        for gpu in (least, least + (most - least) // 3, (least + most) // 2, most):
            p = planner(c, gpu_budget_bytes=gpu, host_budget_bytes=100 * GIB, costs=costs)
            got = resolve(p)
            assert got.fits and got.gpu.total_bytes <= gpu
            for k in range(p.max_layers() + 1):  # every layer count at every fraction that fits
                for i in range(STEPS + 1):
                    q = p.evaluate(i / STEPS, k)
                    if q.fits and (i == 0 or not p.evaluate((i - 1) / STEPS, k).fits):  # the smallest fitting
                        assert p.pricer.price(q).total_s * 1.01 >= got.step_time.total_s  # within 1%: a tie


def test_nothing_fits_below_the_least_gpu_memory():
    c = cfg()
    p = planner(c, gpu_budget_bytes=GIB, host_budget_bytes=GIB)
    least = p.evaluate(1.0, p.max_layers()).gpu.total_bytes
    with pytest.raises(NothingFits, match=r'no optimizer\.optimizer_offload_fraction and '
                                          r'model\.cpu_offloading_num_layers fits \("auto"\)'):  # fmt: skip
        resolve(planner(c, gpu_budget_bytes=least - 1, host_budget_bytes=100 * GIB))


def test_the_plan_shows_its_predicted_step_and_the_next_two():
    c = cfg()
    p = planner(c, gpu_budget_bytes=both_routes_fit(c), host_budget_bytes=100 * GIB, costs=CHEAP_CPU)
    got = resolve(p)
    assert len(got.next_best) == 2
    keys = {(got.fraction, got.offloaded_layers, got.recomputed_layers)}
    for f, k, r, t in got.next_best:
        assert (f, k, r) not in keys  # distinct mixes
        keys.add((f, k, r))
        q = p.evaluate(f, k, r=r)
        assert q.fits and p.pricer.price(q) == t and t.total_s * 1.01 >= got.step_time.total_s
    text = format_plan(got)
    assert f"predicted step: {1000 * got.step_time.total_s:,.0f} ms" in text
    assert "rates: PCIe 0.0/0.0 GB/s stated, CPU AdamW 1000000.0 G params/s stated" in text
    assert "copies slow, CPU step free" in text
    f, k, r, t = got.next_best[0]
    assert f"next candidate: fraction {f:.2f}, {k} offloaded, {r} recomputed layers: {1000 * t.total_s:,.0f} ms" in text
    js = json.loads(json.dumps(got.to_json()))
    assert js["predicted_step"]["total_ms"] == round(1000 * got.step_time.total_s, 3)
    assert [(x["fraction"], x["offloaded_layers"], x["recomputed_layers"]) for x in js["next_candidates"]] == [
        (f, k, r) for f, k, r, _ in got.next_best
    ]


def test_a_plan_without_auto_is_priced_too():
    got = resolve(planner(cfg(layers=2, fraction=0.25), gpu_budget_bytes=100 * GIB, host_budget_bytes=100 * GIB))
    assert got.step_time is not None and got.next_best == () and got.step_time.cpu_step_s > 0


def test_recompute_is_chosen_when_it_is_cheapest_and_never_on_an_offloaded_layer():
    c = cfg(recompute=True)
    budget = both_routes_fit(c)
    # copies and the CPU step slow, compute fast: recompute the layers the memory needs
    fast_compute = Costs(SLOW, SLOW, SLOW, FAST, 1e12, "test: compute free")
    got = chosen(c, fast_compute, gpu=budget)
    assert got.recomputed_layers > 0 and got.fraction == 0.0
    assert got.offloaded_layers + got.recomputed_layers <= 12
    # slow compute, free copies: offload, recompute nothing
    got = chosen(c, Costs(FAST, FAST, SLOW, 1e9, 1e12, "test: compute slow"), gpu=budget)
    assert got.recomputed_layers == 0 and got.offloaded_layers > 0
    # copies that hide for 2 layers: the mixes weighed offload some layers and recompute others, never the same
    p = planner(c, gpu_budget_bytes=budget, host_budget_bytes=100 * GIB, costs=Costs(1e9, 1e9, SLOW, 1e12, 1e12, "t"))
    got = resolve(p)
    mixes = [(got.fraction, got.offloaded_layers, got.recomputed_layers), *(x[:3] for x in got.next_best)]
    assert any(k > 0 and r > 0 for _, k, r in mixes)
    for f, k, r in mixes:  # as initialize would build it: the config's rules accept it, the GPT agrees
        built = c.to_dict()
        built["model"].update(cpu_offloading_num_layers=k, recompute_num_layers=r)
        built["optimizer"]["optimizer_offload_fraction"] = f
        model = build_model(load_config(built).model, torch.device("cpu"), seed=0)
        assert not set(model.recompute_layers) & set(range(k)) and len(model.recompute_layers) == r


def test_the_delayed_update_never_gets_fraction_zero():
    roomy = 100 * GIB  # fraction 0 fits, and with the delayed update it would be the fastest
    plain = resolve(planner(cfg(), gpu_budget_bytes=roomy, host_budget_bytes=roomy, costs=CHEAP_PCIE))
    assert plain.fraction == 0.0
    p = planner(cfg(delayed=True), gpu_budget_bytes=roomy, host_budget_bytes=roomy, costs=CHEAP_PCIE)
    delayed = resolve(p)
    # the smallest grid fraction whose split holds a parameter (0.01 of this model is less than its last one)
    floor = next(i for i in range(1, STEPS + 1) if p.evaluate(i / STEPS, 0).cpu_parameters > 0) / STEPS
    assert floor > 0.01 and delayed.fraction == floor and delayed.cpu_parameters > 0
    assert all(f >= floor for f, _, _, _ in delayed.next_best)


def test_a_run_records_the_chosen_mix_once_in_its_metrics(tmp_path, bin_train):
    metrics = tmp_path / "m.jsonl"
    args = ["train.device=cpu", "optimizer.lr_warmup_iters=0", "model.num_layers=2", "model.hidden_size=32",
            "model.seq_length=32", "data.max_bytes=65536", "train.train_iters=2", "model.cpu_offloading=true",
            "model.cpu_offloading_num_layers=auto", "optimizer.optimizer_cpu_offload=true",
            "optimizer.use_distributed_optimizer=true", "optimizer.optimizer_offload_fraction=auto"]  # fmt: skip
    plan = bin_train(*args, "--plan", "--json")
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)
    run = bin_train(*args, f"logging.metrics_file={metrics}")
    assert run.returncode == 0, run.stderr
    header, *rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert header["plan"] == {
        "fraction": planned["fraction"], "offloaded_layers": planned["offloaded_layers"],
        "recomputed_layers": planned["recomputed_layers"],
        "predicted_step_ms": round(planned["predicted_step"]["total_ms"], 1),
        "auto": ["model.cpu_offloading_num_layers", "optimizer.optimizer_offload_fraction"],
        "costs": planned["predicted_step"]["costs"],
    }  # fmt: skip
    assert header["plan"]["predicted_step_ms"] > 0 and "stated CPU defaults" in header["plan"]["costs"]
    assert len(rows) == 2 and not any("plan" in r for r in rows)  # once, at the start


def test_steps_within_one_percent_are_a_tie_won_by_the_lighter_mix():
    from types import SimpleNamespace

    from engine.planning.auto import _choose

    def mix(f):
        return SimpleNamespace(fraction=f)

    heavy, light, lighter_but_slow, other = mix(0.0), mix(0.1), mix(0.0), mix(0.2)
    got, rest = _choose([(0.990, 4, heavy), (0.995, 1, light), (1.020, 0, lighter_but_slow), (0.999, 1, other)])
    assert got is light  # 1% above the fastest (0.990) is 0.9999: light and other tie with heavy; light: least f
    assert rest == [heavy, other, lighter_but_slow]  # the others, fastest first
    got, _ = _choose([(0.990, 4, heavy), (1.000, 1, light)])
    assert got is heavy  # 1.000 is more than 1% above 0.990
