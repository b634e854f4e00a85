"""Meta-device construction (engine.models.init, engine.build): nothing is allocated before the model is
materialised on its device in its final dtype; initial weights depend on the seed alone, not on the optimizer
or offload settings; half weights are the fp32 draw rounded; a user's model is placed without a copy."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import engine
from engine import build
from engine.config import load_config
from engine.extras import available as has_megatron
from engine.models import init

needs_megatron = pytest.mark.skipif(not has_megatron(), reason="Requires: megatron-core")


@pytest.fixture(scope="module", autouse=True)
def _megatron_state():
    # megatron-core's state is process-global: undo what this module set up so other tests see none of it
    yield
    if has_megatron():
        from engine import megatron

        megatron.teardown()


@pytest.fixture
def model_cfg(tiny_config):
    """`model_cfg(**model_keys)`: the tiny config's model section with those keys changed."""
    return lambda **kw: load_config({"model": {**tiny_config["model"], **kw}}).model


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("implementation", ["builtin", pytest.param("megatron", marks=needs_megatron)])
def test_construction_allocates_nothing_before_materialisation(monkeypatch, model_cfg, implementation):
    seen = []
    real = init.materialize

    def spy(model, device, dtype, seed):
        seen.append([(n, p.device.type) for n, p in model.named_parameters()])
        return real(model, device, dtype, seed)

    monkeypatch.setattr(build, "materialize", spy)
    if implementation == "megatron":
        import engine.megatron.gpt as mgpt

        monkeypatch.setattr(mgpt, "materialize", spy)
    model = build.build_model(model_cfg(implementation=implementation), torch.device("cpu"), 1, torch.bfloat16)
    assert len(seen) == 1 and seen[0], "the builder did not go through materialize"
    assert all(dev == "meta" for _, dev in seen[0]), [n for n, dev in seen[0] if dev != "meta"]
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in model.parameters())


def test_peak_host_memory_of_a_half_build_stays_below_the_fp32_model():
    """In a fresh process: building ~130 M parameters in bf16 raises the peak RSS by the bf16 weights plus one
    draw chunk, well under the 0.5 GB an fp32 build (then cast) needs."""
    code = textwrap.dedent(
        """
        import torch
        torch.set_num_threads(1)
        from engine.build import build_model
        from engine.config import load_config
        from engine.models.init import CHUNK
        def hwm():
            return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
        cfg = load_config({"model": {"num_layers": 2, "hidden_size": 1024, "num_attention_heads": 8,
                                     "seq_length": 64, "vocab_size": 50000}}).model
        tiny = load_config({"model": {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 1,
                                      "seq_length": 4, "vocab_size": 16}}).model
        build_model(tiny, torch.device("cpu"), 0, torch.bfloat16)  # one-off costs (imports) out of the figure
        before = hwm()
        model = build_model(cfg, torch.device("cpu"), 0, torch.bfloat16)
        n = sum(p.numel() for p in model.parameters())
        print(hwm() - before, n, CHUNK)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=".")
    growth, numel, chunk = map(int, out.stdout.split())
    bound = 2 * numel + 4 * chunk + (64 << 20)  # bf16 weights, one fp32 chunk, allocator slack
    assert bound < 4 * numel * 0.85, "the model is too small for this test to tell fp32 from bf16"
    assert growth < bound, f"peak RSS grew {growth / 2**20:.0f} MiB for {numel / 1e6:.0f} M bf16 parameters"


@pytest.mark.parametrize("implementation", ["builtin", pytest.param("megatron", marks=needs_megatron)])
def test_initial_weights_are_the_same_whatever_the_offload_settings(make_engine, model_cfg, implementation):
    base = [f"model.implementation={implementation}", "train.seed=7"]
    offload = ["optimizer.optimizer_cpu_offload=true", "optimizer.use_distributed_optimizer=true"]
    variants = {
        "plain": [],
        "f0.5": [*offload, "optimizer.optimizer_offload_fraction=0.5"],
        "f1-overlap": [
            *offload,
            "optimizer.optimizer_offload_fraction=1.0",
            "optimizer.overlap_cpu_optimizer_d2h_h2d=true",
        ],  # fmt: skip
        "activations": ["model.cpu_offloading=true", "model.cpu_offloading_num_layers=1"],
    }
    got = {}
    for name, extra in variants.items():
        eng, _, _ = make_engine([*base, *extra])
        got[name] = weights(eng.module)
    ref = got["plain"]
    for name, w in got.items():
        assert w.keys() == ref.keys()
        for n in ref:
            assert torch.equal(w[n], ref[n]), f"{name}: {n}"
    direct = build.build_model(model_cfg(implementation=implementation), torch.device("cpu"), 7)
    assert all(torch.equal(p, ref[n]) for n, p in direct.named_parameters())


@pytest.mark.parametrize("implementation", ["builtin", pytest.param("megatron", marks=needs_megatron)])
def test_initial_weights_are_deterministic_per_seed(model_cfg, implementation):
    cfg = model_cfg(implementation=implementation)
    a, b, c = (weights(build.build_model(cfg, torch.device("cpu"), s)) for s in (3, 3, 4))
    assert all(torch.equal(a[n], b[n]) for n in a)
    drawn = [n for n in a if a[n].dim() >= 2]
    assert drawn and not any(torch.equal(a[n], c[n]) for n in drawn)


@pytest.mark.parametrize("implementation", ["builtin", pytest.param("megatron", marks=needs_megatron)])
def test_half_weights_are_the_fp32_draw_rounded_across_chunks(monkeypatch, model_cfg, implementation):
    monkeypatch.setattr(init, "CHUNK", 100)  # several chunks per tensor, so chunking is exercised
    cfg = model_cfg(implementation=implementation)
    full = weights(build.build_model(cfg, torch.device("cpu"), 5))
    for dtype in (torch.bfloat16, torch.float16):
        half = weights(build.build_model(cfg, torch.device("cpu"), 5, dtype))
        for n, p in half.items():
            assert p.dtype == dtype and torch.equal(p, full[n].to(dtype)), n


@pytest.mark.parametrize("implementation", ["builtin", pytest.param("megatron", marks=needs_megatron)])
def test_init_scheme_by_parameter_kind(implementation):
    std, layers = 0.05, 3
    cfg = load_config({"model": {"num_layers": layers, "hidden_size": 256, "num_attention_heads": 4,
                                 "seq_length": 64, "vocab_size": 512, "init_method_std": std,
                                 "implementation": implementation}}).model  # fmt: skip
    model = build.build_model(cfg, torch.device("cpu"), 0)
    kinds = set()
    for n, p in model.named_parameters():
        if p.dim() == 1:
            kind = "norm" if n.endswith("norm.weight") else "bias"
            assert torch.all(p == (1.0 if kind == "norm" else 0.0)), n
        else:
            kind = "out" if n.endswith(("proj.weight", "fc2.weight")) else "matrix"
            want = std / (2 * layers) ** 0.5 if kind == "out" else std
            assert abs(p.std().item() / want - 1) < 0.05 and abs(p.mean().item()) < want / 20, n
        kinds.add(kind)
    assert kinds == {"norm", "bias", "out", "matrix"}


def test_a_users_model_is_used_in_place(make_engine):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    eng, _, _ = make_engine(model=model, loss_fn=nn.functional.mse_loss)
    assert eng.module is model
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage


def test_a_users_meta_model_is_materialised_and_reset(make_engine):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    eng, _, _ = make_engine(["train.precision=bf16", "train.params_dtype=half"], model=model,
                            loss_fn=nn.functional.mse_loss)  # fmt: skip
    ps = dict(model.named_parameters())
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in ps.values())
    assert torch.all(ps["1.weight"] == 1) and ps["0.weight"].abs().max() > 0
    x, y = torch.randn(2, 4, dtype=torch.bfloat16), torch.randn(2, 1, dtype=torch.bfloat16)
    assert torch.isfinite(torch.tensor(eng.train_batch(iter([(x, y)] * 2))))


def test_a_meta_model_without_an_init_is_refused_with_the_fix(make_engine):
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3, 3))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Bare())
    with pytest.raises(ValueError, match=r"model: '1' \(1 module\(s\) in all\) holds meta-device tensors and has no "
                                         r"reset_parameters\(\); give the model an init_from_seed"):  # fmt: skip
        make_engine(model=model, loss_fn=nn.functional.mse_loss)


def test_meta_built_gpt_ties_and_attributes_survive():
    """materialize keeps tied weights tied and the attributes megatron-core sets on parameters."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    model[0].weight.partition_dim = 0
    init.materialize(model, torch.device("cpu"), torch.bfloat16, 0)
    assert model[1].weight is model[0].weight and model[0].weight.partition_dim == 0
    assert model[0].weight.dtype == torch.bfloat16 and len(list(model.parameters())) == 1


@needs_megatron
def test_a_users_meta_megatron_model_gets_the_builders_weights(make_engine, model_cfg):
    """A bare GPTModel built under torch.device("meta") by the user: initialize materialises it behind the
    adapter with the same weights build_gpt gives for the run's seed."""
    from megatron.core.models.gpt import GPTModel

    from engine import megatron
    from engine.megatron.gpt import _with_torch_final_norm, layer_spec

    cfg = model_cfg(implementation="megatron")
    megatron.ensure_model_parallel(device="cpu")
    with torch.device("meta"):
        gpt = GPTModel(
            config=megatron.transformer_config(cfg),
            transformer_layer_spec=_with_torch_final_norm(layer_spec(False, "auto", torch.device("cpu")), 2),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.seq_length,
            share_embeddings_and_output_weights=False,
            position_embedding_type="learned_absolute",
        )
    eng, _, _ = make_engine(["train.seed=11"], model=gpt)
    assert isinstance(eng.module, megatron.MegatronGPT)
    ref = build.build_model(cfg, torch.device("cpu"), 11)
    for (n, p), (m, q) in zip(eng.module.named_parameters(), ref.named_parameters(), strict=True):
        assert n == m and torch.equal(p, q), n
    assert eng.train_batch() > 0


@pytest.mark.parametrize("implementation", ["builtin", pytest.param("megatron", marks=needs_megatron)])
def test_the_plan_counts_no_host_copy_while_the_builtin_gpt_is_built(tiny_config, implementation):
    """The memory plan of a CUDA run: the construction phase holds only the runtime and the data, since the model
    is allocated on the GPU (it counted 4 B per parameter on the host when the GPT was built there)."""
    cfg = {**tiny_config, "model": {**tiny_config["model"], "implementation": implementation},
           "train": {**tiny_config["train"], "device": "auto"}}  # fmt: skip
    plan = engine.plan(cfg, gpu_budget_bytes=80 << 30, host_budget_bytes=64 << 30)
    construction = plan.host.phases["construction"]
    assert construction == plan.host.parts["runtime"] + plan.host.parts["data"]
