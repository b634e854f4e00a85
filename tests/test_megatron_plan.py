"""The memory plan of `model.implementation="megatron"` on CPU: its census is megatron-core's GPTModel (parameters
and layers counted from the model, a layer's saved storages equal to a measured megatron layer), "auto" resolves
through it, `engine.initialize` trains it with activation offload and the hybrid optimizer, and the reference's
offload rules hold for it with Megatron's messages."""

import pytest
import torch

pytest.importorskip("megatron.core", reason="Requires: megatron-core")

from engine import megatron  # noqa: E402
from engine.config import ConfigError, load_config  # noqa: E402
from engine.megatron import gpt  # noqa: E402
from engine.megatron.gpt import meta_gpt  # noqa: E402
from engine.optim.partition import forward_order  # noqa: E402
from engine.planning import plan  # noqa: E402
from engine.planning.activations import measure_layer_once  # noqa: E402
from engine.planning.megatron import megatron_census  # noqa: E402

SHAPE = {"implementation": "megatron", "num_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
         "seq_length": 64, "vocab_size": 128}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _parallel_state():
    yield
    megatron.teardown()  # megatron-core's state is process-global


def config(**train):
    train = {"device": "cpu", "micro_batch_size": 2, "global_batch_size": 4, **train}
    return load_config({"model": dict(SHAPE), "train": train})


def built(cfg, dtype):
    return megatron.build_gpt(cfg.model, device="cpu", seed=0, dtype=dtype)


@pytest.mark.parametrize("params_dtype", ["fp32", "half"])
def test_census_counts_the_megatron_models_own_parameters_in_forward_order(params_dtype):
    precision = "fp32" if params_dtype == "fp32" else "bf16"
    cfg = config(precision=precision, params_dtype=params_dtype)
    census = megatron_census(cfg, cuda=False)
    model = built(cfg, torch.float32 if params_dtype == "fp32" else torch.bfloat16)
    real = [(n, p.numel()) for n, p in model.named_parameters()]
    named = census.expanded()
    assert sorted((n, x) for n, x, _ in named) == sorted(real)
    assert census.parameters == sum(p.numel() for p in model.parameters())
    assert census.weight_bytes == sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    for n, _, group in named:  # each decoder parameter in its layer, the embedding and output outside them
        assert isinstance(group, str) == (".layers." not in n), n
        if not isinstance(group, str):
            assert n.startswith(f"gpt.decoder.layers.{group}."), n
    # in the hybrid optimizer's order (engine.optim.partition.forward_order over the model's names)
    assert [n for n, _, _ in named] == forward_order([n for n, _ in real])


@pytest.mark.parametrize("depth", [1, 2, 7])
def test_census_at_depth_n_equals_the_full_depth_build(depth, monkeypatch):
    """Built at two layers and counted per layer shape, the census holds every parameter of the model megatron
    builds at the full depth: names, sizes, order, gradient groups and weight bytes."""
    cfg = load_config({"model": {**SHAPE, "num_layers": depth}, "train": {"device": "cpu", "params_dtype": "half",
                                                                           "precision": "bf16"}})  # fmt: skip
    depths = []
    monkeypatch.setattr(gpt, "meta_gpt", lambda m, **kw: (depths.append(m.num_layers), meta_gpt(m, **kw))[1])
    census = megatron_census(cfg, cuda=False)
    assert depths == [min(depth, 2)]  # built at two layers whatever the depth
    full = meta_gpt(cfg.model)
    index = {id(p): i for i, layer in enumerate(full.layers) for p in layer.parameters()}
    names = forward_order([n for n, _ in full.named_parameters()])
    params = dict(full.named_parameters())
    first = next(i for i, n in enumerate(names) if id(params[n]) in index)
    want = [(n, params[n].numel(), index.get(id(params[n]), "input" if i < first else "output"))
            for i, n in enumerate(names)]  # fmt: skip
    assert census.expanded() == want and census.n_layers == depth
    assert census.parameters == sum(p.numel() for p in full.parameters())
    assert census.weight_bytes == 2 * sum(x.numel() for x in [*full.parameters(), *full.buffers()])
    assert [r.count for r in census.runs if r.count > 1] == ([depth] if depth > 1 else [])  # the layers: one run


@pytest.mark.parametrize("params_dtype", ["fp32", "half"])
def test_census_layer_activations_equal_a_measured_megatron_layer_storage_by_storage(params_dtype):
    precision = "fp32" if params_dtype == "fp32" else "bf16"
    cfg = config(precision=precision, params_dtype=params_dtype, micro_batch_size=1)
    census = megatron_census(cfg, cuda=False)
    model = built(cfg, torch.float32 if params_dtype == "fp32" else torch.bfloat16)
    measured = measure_layer_once(model, model.layers[0], SHAPE["seq_length"])
    assert [s.nbytes for s in census.activations.layers[0]] == [s.nbytes for s in measured]
    assert census.activations.source == "formula (megatron-core GPTModel)"


def test_megatrons_own_attention_on_cuda_is_planned_with_its_seq_by_seq_probabilities():
    cfg = config(precision="bf16", params_dtype="half", micro_batch_size=2)
    cpu, gpu = megatron_census(cfg, cuda=False), megatron_census(cfg, cuda=True)
    s, heads = SHAPE["seq_length"], SHAPE["num_attention_heads"]
    probs = 2 * heads * s * s * (4 + 2)  # fp32 softmax and its bf16 copy
    lse = 2 * heads * s * 4
    # CUDA's LayerNorm keeps fp32 statistics for half inputs: 4 norms x [tokens] x 2 extra bytes
    assert gpu.activations.layer_bytes(0) - cpu.activations.layer_bytes(0) == probs - lse + 4 * 2 * s * 2
    assert any("DotProductAttention" in n for n in gpu.notes)


def test_auto_resolves_against_the_megatron_census_at_8b():
    shape = {**SHAPE, "num_layers": 40, "hidden_size": 4096, "num_attention_heads": 32, "seq_length": 2048,
             "vocab_size": 50304, "cpu_offloading": True, "cpu_offloading_num_layers": "auto"}  # fmt: skip
    raw = {"model": shape, "train": {"precision": "bf16", "params_dtype": "half", "micro_batch_size": 1,
                                                                       "global_batch_size": 8},
           "optimizer": {"optimizer_cpu_offload": True, "use_distributed_optimizer": True,
                         "optimizer_offload_fraction": "auto"}}  # fmt: skip
    p = plan(raw, gpu_budget_bytes=139 << 30, host_budget_bytes=125 << 30)
    assert p.fits and p.auto["optimizer.optimizer_offload_fraction"] and 0 < p.fraction <= 1
    with torch.device("meta"):
        n = sum(x.numel() for x in megatron.meta_gpt(load_config(raw).model).parameters())
    assert p.parameters == n
    assert p.activations_source == "formula (megatron-core GPTModel)"
    tight = plan(raw, gpu_budget_bytes=110 << 30, host_budget_bytes=125 << 30)
    assert tight.fraction > p.fraction or tight.offloaded_layers > p.offloaded_layers


def test_initialize_plans_and_trains_megatron_with_auto_activation_and_optimizer_offload(make_engine):
    eng, opt, _ = make_engine([
        "model.implementation=megatron", "model.cpu_offloading=true", "model.cpu_offloading_num_layers=auto",
        "optimizer.optimizer_cpu_offload=true", "optimizer.use_distributed_optimizer=true",
        "optimizer.optimizer_offload_fraction=auto", "optimizer.lr=3e-3", "train.train_iters=8",
    ])  # fmt: skip
    assert type(eng.module).__name__ == "MegatronGPT"
    cfg = eng.config
    assert isinstance(cfg.optimizer.optimizer_offload_fraction, float)
    assert isinstance(cfg.model.cpu_offloading_num_layers, int)
    losses = [eng.train_batch() for _ in range(8)]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.cpu_offloading=true", "model.cpu_offloading_num_layers=1", "model.pipeline_model_parallel_size=2"],
         "Currently there is no support for Pipeline parallelism with CPU offloading"),
        (["model.cpu_offloading=true", "model.cpu_offloading_num_layers=1", "model.recompute_granularity=full"],
         "CPU offloading does not work when activation recomputation is enabled"),
        (["model.cpu_offloading=true", "model.fine_grained_activation_offloading=true",
          'model.offload_modules=["mlp"]'],
         "fine_grained_activation_offloading cannot be enabled with cpu_offloading"),
        (["model.cpu_offloading=true", "model.cpu_offloading_num_layers=1", "model.cuda_graph_impl=local"],
         "CUDA graphs not supported with CPU offloading"),
        (["model.cpu_offloading=true", "model.cpu_offloading_num_layers=3"],
         "CPU offloading can be done only for layers less than 3"),
        (["optimizer.optimizer_cpu_offload=true"], "optimizer_cpu_offload requires use_distributed_optimizer=True"),
        (["optimizer.implementation=megatron", "optimizer.cpu_offload_gpu_assist=true"],
         "applies only to optimizer.implementation='engine'"),
    ],
)  # fmt: skip
def test_megatron_offload_rules_use_megatrons_messages(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"model": dict(SHAPE)}, overrides)


def test_bench_scale_runs_megatron_against_its_fitting_twin(tmp_path, monkeypatch):
    import json

    from engine.bench import scale

    built = []
    real = megatron.build_gpt
    monkeypatch.setattr(megatron, "build_gpt", lambda m, **kw: built.append(m.num_layers) or real(m, **kw))
    out = tmp_path / "scale.json"
    argv = ["--layers-fit", "1", "--layers", "2", "--hidden", "32", "--seq", "16", "--global-batch", "2", "--iters",
            "2", "--warmup", "1", "--data-bytes", "100000", "--device", "cpu", "--rows", "fit,exact",
            "--implementation", "megatron", "--json", str(out)]  # fmt: skip
    assert scale.main(argv) == 0
    assert built == [1, 2]  # the twin and the deep model, both megatron-core's
    rows = {r["name"]: r for r in json.load(open(out))["rows"]}
    assert rows["fit"]["fraction"] == 0.0 and rows["exact"]["fraction"] > 0
    assert all(len(r["losses"]) == 3 and r["iter_ms"] > 0 for r in rows.values())
