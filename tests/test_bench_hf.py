"""bin/bench scale --hf-config on CPU: the named shapes and their counts, the twin's depth from the plan, the rows
end to end for a tiny Llama (named) and a tiny Qwen3-MoE (from a config.json), and the refusals."""

import argparse
import json

import pytest
import torch

from engine.bench import hf_models, hf_scale, scale, scale_run

T = pytest.importorskip("transformers")

TINY = ["--device", "cpu", "--seq", "32", "--global-batch", "2", "--iters", "2", "--warmup", "1",
        "--data-bytes", "100000"]  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread (conftest)


@pytest.mark.parametrize("name,params", [("llama3-8b", 8_030_261_248), ("qwen2.5-7b", 7_615_616_512),
                                         ("qwen3-30b-a3b", 30_532_122_624)])  # fmt: skip
def test_named_shapes_are_the_published_models(name, params):
    model = hf_models.meta_model(hf_models.hf_config(hf_models.shape_of(name)))
    assert sum(p.numel() for p in model.parameters()) == params


def test_moe_flops_count_the_experts_a_token_is_routed_to():
    """Qwen3-30B-A3B: per layer attention (q, o: 2048 x 4096; k, v: 2048 x 512), the router (128 x 2048) and 8 of
    128 experts (gate, up, down: 3 x 2048 x 768), plus the untied head; 3.35 B active with the embedding."""
    cfg = hf_models.hf_config(hf_models.shape_of("qwen3-30b-a3b"))
    model = hf_models.meta_model(cfg)
    per_layer = 2 * 2048 * 4096 + 2 * 2048 * 512 + 128 * 2048 + 8 * 3 * 2048 * 768
    n = 48 * per_layer + 2048 * 151936
    f = hf_models.flops_per_token(model, cfg, 4096)
    assert f["n"] == n and f["total"] == 6 * n + 12 * 48 * 32 * 128 * 4096
    assert 3.3e9 < n + 2048 * 151936 < 3.4e9


def test_dense_flops_are_the_llama_formula_and_a_tied_head_counts_once():
    cfg = hf_models.hf_config(hf_models.shape_of("tiny"))
    h, f, layers, kv, v = 64, 256, 3, 32, 256
    n = layers * (2 * h * h + 2 * h * kv + 3 * h * f) + h * v
    model = hf_models.meta_model(cfg)
    assert hf_models.flops_per_token(model, cfg, 32)["total"] == 6 * n + 12 * layers * h * 32
    tied = hf_models.meta_model(hf_models.hf_config({**hf_models.shape_of("tiny"), "tie_word_embeddings": True}))
    assert hf_models.active_matmul_params(tied, cfg) == n


def test_an_unknown_name_is_one_line_listing_the_known_ones(capsys):
    assert scale.main(["--hf-config", "llama-9b", *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "llama-9b" in err[0] and "llama3-8b, qwen2.5-7b, qwen3-30b-a3b" in err[0], err


def test_a_config_json_without_model_type_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert scale.main(["--hf-config", str(tmp_path), *TINY]) == 2
    assert "model_type" in capsys.readouterr().err


@pytest.mark.parametrize("flags,named", [(["--hidden", "64"], "--hidden"), (["--te"], "--te"),
                                         (["--implementation", "megatron"], "--implementation megatron")])  # fmt: skip
def test_built_in_gpt_flags_are_refused_with_a_hf_config(flags, named):
    with pytest.raises(SystemExit, match=f"{named}: describe the built-in GPT"):
        scale.main(["--hf-config", "tiny", *TINY, *flags])


def test_layers_auto_is_refused_for_the_built_in_gpt():
    with pytest.raises(SystemExit, match="--layers auto"):
        scale.main([*TINY, "--layers", "auto"])


def _plan_total(a, layers: int, budget: int) -> tuple[int, object, object, dict]:
    """The fit row's planned GPU bytes (planned for CUDA) of the tiny Llama really built at `layers` layers."""
    from engine.planning import planner

    shape = hf_scale.HFShape("tiny", hf_models.shape_of("tiny"), layers, 32)
    cfg = scale_run.row_config(a, shape, 0.0, False)
    model, batch = shape.build(torch.device("cpu"), 0, cfg), next(shape.batches(scale.stdlib_bytes(100000), 1, 0))
    p = planner(cfg, model, device="cuda", gpu_budget_bytes=budget, host_budget_bytes=budget, example_batch=batch)
    return p.evaluate(0.0, 0).gpu.total_bytes, model, batch, cfg


def test_the_twin_depth_is_the_deepest_whose_plan_fits():
    """The search cuts the deep model's census to fewer layers: its figure at 2 layers is within 0.1% of the plan
    of a 2-layer model really built, and a budget between the 2- and 3-layer plans gives depth 2."""
    a = scale.parse_args(["--hf-config", "tiny", *TINY])
    huge = 1 << 40
    two, *_ = _plan_total(a, 2, huge)
    three, model, batch, cfg = _plan_total(a, 3, huge)
    assert two < three
    ns = lambda gpu: argparse.Namespace(**{**vars(a), "device": "cuda", "gpu_memory": gpu, "host_memory": huge})  # noqa: E731
    assert hf_scale.depth_bound(ns((two + three) // 2), cfg, model, batch) == 2
    assert hf_scale.depth_bound(ns(three), cfg, model, batch) == 3
    assert hf_scale.depth_bound(ns(1 << 20), cfg, model, batch) == 0
    from engine.planning import planner
    from engine.planning.auto import Planner

    p = planner(cfg, model, device="cuda", gpu_budget_bytes=huge, host_budget_bytes=huge, example_batch=batch)
    cut = Planner(p.cfg, p.census.truncated(2, p.settings.weight_elem), p.settings, cuda=True, gpu_budget=huge,
                  host_budget=huge)  # fmt: skip
    assert cut.evaluate(0.0, 0).gpu.total_bytes == pytest.approx(two, rel=1e-3)


def test_hf_rows_on_cpu(tmp_path, capsys):
    """A named shape: the twin at --layers-fit, exact and dpu at the config's depth, each built from the same seed
    and planned at its first micro-batch; TFLOP/s from the HF formula."""
    out = tmp_path / "scale.json"
    assert scale.main(["--hf-config", "tiny", *TINY, "--layers-fit", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "FLOPs per token = 6*N + 12*L*a*s" in text and "tiny (LlamaForCausalLM)" in text
    rows = {r["name"]: r for r in json.load(open(out))["rows"]}
    assert list(rows) == ["fit", "exact", "dpu"]
    assert rows["fit"]["layers"] == 2 and rows["exact"]["layers"] == rows["dpu"]["layers"] == 3
    for name, r in rows.items():
        shape = hf_scale.HFShape("tiny", hf_models.shape_of("tiny"), r["layers"], 32)
        built = shape.build(torch.device("cpu"), 0, {})
        assert r["params"] == sum(p.numel() for p in built.parameters()), name
        assert r["tflops"] == pytest.approx(r["tokens_per_s"] * shape.flops_per_token()["total"] / 1e12)
        assert len(r["losses"]) == 3 and r["plan_host_bytes"] > 0 and r["plan_gpu_bytes"] is None
    assert rows["fit"]["fraction"] == 0.0 and rows["exact"]["fraction"] == 0.3
    assert rows["exact"]["cpu_step_ms"] is not None and rows["dpu"]["delayed_steps"] == [3]
    assert rows["exact"]["losses"][0] == rows["dpu"]["losses"][0]  # the same initial weights and first batch


def test_moe_from_a_config_json_at_the_planned_depth_and_fractions(tmp_path, capsys):
    """A Qwen3-MoE config.json, --layers auto and one row per fraction (tools/moe_gpu.sh's rows): every row at one
    depth, the fraction each asked for, and the same losses (the CPU-stepped part does the same arithmetic)."""
    (tmp_path / "config.json").write_text(json.dumps(hf_models.SHAPES["tiny-moe"]))
    out = tmp_path / "scale.json"
    argv = ["--hf-config", str(tmp_path), *TINY, "--layers", "auto", "--rows=", "--fractions", "0,0.5,1",
            "--json", str(out)]  # fmt: skip
    assert scale.main(argv) == 0
    text = capsys.readouterr().out
    assert "--layers auto: the plan fits, of 3 layers, f=0: 3, f=0.5: 3, f=1: 3" in text
    rows = json.load(open(out))["rows"]
    assert [r["name"] for r in rows] == ["f=0", "f=0.5", "f=1"]
    assert [r["fraction"] for r in rows] == [0.0, 0.5, 1.0] and {r["layers"] for r in rows} == {3}
    assert rows[0]["cpu_step_ms"] is None and rows[2]["host_engine_bytes"] > rows[1]["host_engine_bytes"] > 0
    assert rows[0]["cpu_params"] == 0 and rows[2]["cpu_params"] == rows[2]["params"]
    assert 0.4 < rows[1]["cpu_params"] / rows[1]["params"] < 0.6  # split by whole tensors: near the fraction
    for r in rows[1:]:
        assert r["losses"] == pytest.approx(rows[0]["losses"], rel=1e-6)


@pytest.mark.parametrize("bad,match", [(["--rows", "fit,exakt"], "unknown exakt"),
                                       (["--fractions", "0,1.5"], "--fractions 1.5"),
                                       (["--layers", "0"], "--layers 0"),
                                       (["--gpu-memory", "x"], "--gpu-memory x")])  # fmt: skip
def test_malformed_flags_are_one_line(bad, match):
    with pytest.raises(SystemExit, match=match):
        scale.main(["--hf-config", "tiny", *TINY, *bad])
