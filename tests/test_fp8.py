"""FP8 through Transformer Engine (`train.fp8*`): the config's refusals, the recipe built from Megatron's keys, and
(on CUDA with TE) the built-in GPT's TE layers trained under FP8 with activation offload and the hybrid optimizer."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from engine import extras
from engine.config import ConfigError, load_config
from engine.config import rules as config_rules
from engine.precision import fp8_capability_problem, fp8_recipe_kwargs

FP8 = {"model": {"use_te": True}, "train": {"fp8": "e4m3"}}


def errors(source: dict, model_in_hand: bool = False) -> list[str]:
    try:
        load_config(source, model_in_hand=model_in_hand)
    except ConfigError as e:
        return e.errors
    return []


def fp8_lines(source: dict, **kw) -> list[str]:
    return [e for e in errors(source, **kw) if e.startswith(("train.fp8", "model.recompute_granularity"))]


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA machine with TE installed, of compute capability `gpu.capability` (default H200's 9.0)."""
    state = SimpleNamespace(capability=(9, 0))
    monkeypatch.setattr(extras, "te_missing", lambda: None)
    monkeypatch.setattr(config_rules, "_cuda", lambda: True)
    monkeypatch.setattr(config_rules, "_capability", lambda: state.capability)
    return state


def with_train(**train) -> dict:
    return {**FP8, "train": {**FP8["train"], **train}}


# --- the refusals: one line each, naming the key, the value and the fix ----------------------------------------


def test_fp8_without_te_layers_is_refused(gpu):
    assert fp8_lines({"train": {"fp8": "hybrid"}}) == [
        'train.fp8="hybrid": FP8 runs in Transformer Engine layers only; set model.use_te=true (the built-in GPT\'s '
        "TE layers, or megatron-core's TE spec), or train.fp8=null"
    ]


def test_fp8_without_te_installed_is_refused(gpu, monkeypatch):
    monkeypatch.setattr(extras, "te_missing", lambda: "needs Transformer Engine: pip install -e '.[te]'")
    assert fp8_lines(FP8) == [
        "train.fp8=\"e4m3\": needs Transformer Engine: pip install -e '.[te]', or set train.fp8=null"
    ]


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_fp8_without_cuda_is_refused(gpu, monkeypatch, device):
    if device == "auto":  # no GPU on this machine
        monkeypatch.setattr(config_rules, "_cuda", lambda: False)
    lines = fp8_lines(with_train(device=device))
    assert lines == ['train.fp8="e4m3": FP8 runs on CUDA only; set train.device="auto" or "cuda" on a GPU, or '
                     "train.fp8=null"]  # fmt: skip


def test_the_h200_takes_delayed_tensorwise_and_blockwise(gpu):
    for recipe in ("delayed", "tensorwise", "blockwise"):
        assert errors(with_train(fp8_recipe=recipe)) == [], recipe


def test_mxfp8_before_blackwell_is_refused(gpu):
    assert fp8_lines(with_train(fp8_recipe="mxfp8")) == [
        'train.fp8_recipe="mxfp8": the mxfp8 FP8 recipe needs a GPU of Blackwell (compute capability 10.0+); this '
        'one is 9.0; set train.fp8_recipe="delayed" or "tensorwise"'
    ]
    gpu.capability = (10, 0)
    assert errors(with_train(fp8_recipe="mxfp8")) == []


def test_fp8_before_ada_is_refused(gpu):
    gpu.capability = (8, 0)  # A100: no FP8 tensor cores
    assert fp8_lines(FP8) == ['train.fp8="e4m3": the delayed FP8 recipe needs a GPU of compute capability 8.9+; '
                              "this one is 8.0; set train.fp8=null"]  # fmt: skip


def test_fp8_capability_table():
    assert fp8_capability_problem("delayed", (8, 9)) is None
    assert fp8_capability_problem("tensorwise", (9, 0)) is None
    assert "compute capability 9.0+" in fp8_capability_problem("blockwise", (8, 9))
    assert "Blackwell" in fp8_capability_problem("mxfp8", (9, 0))
    assert fp8_capability_problem("mxfp8", (12, 0)) is None


def test_fp8_with_recompute_is_refused(gpu):
    source = {"model": {"use_te": True, "recompute_granularity": "full"}, "train": {"fp8": "e4m3"}}
    assert fp8_lines(source) == [
        'model.recompute_granularity="full": recompute re-runs layers in backward, outside the forward\'s FP8 '
        "context; set model.recompute_granularity=null, or train.fp8=null"
    ]


@pytest.mark.parametrize(("key", "value"), [("fp8_margin", 1), ("fp8_amax_history_len", 16),
                                            ("fp8_amax_compute_algo", "max")])  # fmt: skip
def test_delayed_only_keys_need_the_delayed_recipe(gpu, key, value):
    assert errors(with_train(**{key: value})) == []
    lines = fp8_lines(with_train(fp8_recipe="tensorwise", **{key: value}))
    assert lines == [f'train.{key}={value!r}: acts only with train.fp8 set and train.fp8_recipe="delayed"; set '
                     f"those, or unset train.{key}".replace("'", '"')]  # fmt: skip
    assert len(fp8_lines({"train": {key: value}})) == 1  # without train.fp8 at all


def test_fp8_with_a_model_of_your_own_is_refused(gpu):
    lines = fp8_lines({"train": {"fp8": "e4m3"}}, model_in_hand=True)
    assert lines == [
        'train.fp8="e4m3": the engine puts FP8 only into the GPT it builds with Transformer Engine layers, not into '
        "a model of your own; build your model from TE modules under TE's own fp8_autocast, or set train.fp8=null"
    ]


def test_fp8_unset_is_accepted_everywhere():
    assert errors({}) == []
    assert errors({}, model_in_hand=True) == []


# --- the recipe from Megatron's keys -----------------------------------------------------------------------------


def train_of(**kw):
    """train.* with these values, past the rules (they need TE and a GPU; the mapping does not)."""
    return dataclasses.replace(load_config({}).train, **kw)


def test_delayed_recipe_kwargs_from_the_keys():
    t = train_of(fp8="hybrid", fp8_recipe="delayed", fp8_margin=2, fp8_amax_history_len=16,
                 fp8_amax_compute_algo="max")  # fmt: skip
    assert fp8_recipe_kwargs(t) == ("DelayedScaling", {"fp8_format": "HYBRID", "margin": 2,
                                                       "amax_history_len": 16, "amax_compute_algo": "max"})  # fmt: skip


OTHER_RECIPES = [("tensorwise", "Float8CurrentScaling"), ("blockwise", "Float8BlockScaling"),
                 ("mxfp8", "MXFP8BlockScaling")]  # fmt: skip


@pytest.mark.parametrize(("recipe", "cls"), OTHER_RECIPES)
def test_other_recipes_take_only_the_format(recipe, cls):
    assert fp8_recipe_kwargs(train_of(fp8="e4m3", fp8_recipe=recipe)) == (cls, {"fp8_format": "E4M3"})


def test_the_te_recipe_object():
    pytest.importorskip("transformer_engine.common.recipe", reason="Requires: Transformer Engine")
    from transformer_engine.common import recipe as te_recipe

    from engine.precision import fp8_recipe

    r = fp8_recipe(train_of(fp8="hybrid", fp8_amax_history_len=16, fp8_amax_compute_algo="max", fp8_margin=1,
                            fp8_recipe="delayed"))  # fmt: skip
    assert isinstance(r, te_recipe.DelayedScaling)
    assert (r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.margin) == (te_recipe.Format.HYBRID, 16,
                                                                                 "max", 1)  # fmt: skip
    assert isinstance(fp8_recipe(train_of(fp8="e4m3", fp8_recipe="tensorwise")), te_recipe.Float8CurrentScaling)


# --- on the GPU: the built-in GPT's TE layers trained under FP8 ---------------------------------------------------

SHAPE = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 256, "vocab_size": 512}
STEPS = 20


def train_losses(implementation: str, fp8: str | None, offloaded: bool) -> tuple[list[float], bool]:
    """Losses of STEPS iterations, and whether a TE module ran its forward in FP8."""
    import engine

    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    cfg = {
        "model": {**SHAPE, "use_te": True, "implementation": implementation},
        "optimizer": {"lr": 3e-4, "lr_warmup_iters": 2},
        "train": {"train_iters": STEPS, "global_batch_size": 4, "micro_batch_size": 4, "precision": "bf16",
                  "params_dtype": "half", "fp8": fp8},
        "logging": {"progress_bar": False, "metrics_file": None},
    }  # fmt: skip
    if offloaded:
        cfg["model"].update(cpu_offloading=True, cpu_offloading_num_layers=SHAPE["num_layers"] - 1)
        cfg["optimizer"].update(optimizer_cpu_offload=True, use_distributed_optimizer=True,
                                optimizer_offload_fraction=0.5, overlap_cpu_optimizer_d2h_h2d=True)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, SHAPE["vocab_size"], (4, 4, SHAPE["seq_length"] + 1), generator=g)
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks] * (STEPS // 4)
    eng, _, _ = engine.initialize(config=cfg)
    it = iter(batches)
    losses = [float(eng.train_batch(it)) for _ in range(STEPS)]
    ran_fp8 = any(getattr(m, "fp8", False) is True for m in eng.module.modules())
    del eng
    return losses, ran_fp8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA")
@pytest.mark.skipif(torch.cuda.is_available() and not extras.te_available(),
                    reason="Requires: Transformer Engine (pip install -e '.[te]')")  # fmt: skip
@pytest.mark.parametrize("implementation", ["builtin", "megatron"])
def test_fp8_trains_offloaded_like_fp8_plain_and_near_bf16(implementation):
    """FP8 delayed with activation offload + the hybrid optimizer at 0.5: the same losses as FP8 without either
    (offload moves the FP8 saved tensors and steps the weights TE casts; it changes no value), falling, near bf16."""
    from engine import megatron

    if implementation == "megatron" and not megatron.available():
        pytest.skip("Requires: megatron-core")
    bf16, bf16_fp8 = train_losses(implementation, None, offloaded=False)
    plain, plain_fp8 = train_losses(implementation, "hybrid", offloaded=False)
    off, off_fp8 = train_losses(implementation, "hybrid", offloaded=True)
    if implementation == "megatron":
        megatron.teardown()
    print(implementation, {"bf16": bf16, "fp8": plain, "fp8 offloaded": off})
    assert plain_fp8 and off_fp8 and not bf16_fp8
    assert plain != bf16  # FP8 GEMMs give other values
    assert off[-1] < off[0]
    # the hybrid optimizer's CPU half rounds differently from the GPU's Adam; FP8 casts may amplify that a little
    assert max(abs(a - b) for a, b in zip(plain, off, strict=True)) <= 1e-2
    assert max(abs(a - b) for a, b in zip(bf16, off, strict=True)) <= 0.1


@pytest.fixture
def stand_in_te(monkeypatch):
    """Without TE installed: a stand-in TE whose autocast records what the engine's forward context enters."""
    import contextlib
    import sys
    import types

    entered = []
    te = types.ModuleType("transformer_engine.pytorch")

    @contextlib.contextmanager
    def autocast(enabled, recipe, amax_reduction_group):
        entered.append((enabled, recipe, amax_reduction_group, torch.is_autocast_enabled("cpu")))
        yield

    te.autocast = autocast
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format = SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID")
    recipe.DelayedScaling = lambda **kw: ("DelayedScaling", kw)
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    fakes = {"transformer_engine": types.ModuleType("transformer_engine"), "transformer_engine.pytorch": te,
             "transformer_engine.common": common, "transformer_engine.common.recipe": recipe}  # fmt: skip
    for name, mod in fakes.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return entered


def test_the_forward_runs_under_te_autocast_with_the_recipe(stand_in_te):
    """A stand-in TE records what the engine's forward context enters, once per forward."""
    from engine.precision import forward_context

    ctx = forward_context(torch.device("cpu"), train_of(fp8="hybrid", fp8_amax_history_len=4))
    for _ in range(2):  # TE's context is one-shot: a fresh one each forward
        with ctx():
            pass
    want = ("DelayedScaling", {"fp8_format": "HYBRID", "margin": 0, "amax_history_len": 4,
                               "amax_compute_algo": "most_recent"})  # fmt: skip
    assert stand_in_te == [(True, want, None, True)] * 2  # inside bf16 autocast (fp32 weights), one rank: no group
    stand_in_te.clear()
    with forward_context(torch.device("cpu"), train_of())():
        pass
    assert stand_in_te == []


class RecordingLayer(torch.nn.Module):
    """Stands in for a TE TransformerLayer: records the is_first_microbatch each forward gets ("unset": none)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def forward(self, x: torch.Tensor, **kw) -> torch.Tensor:
        self.seen.append(kw.get("is_first_microbatch", "unset"))
        return x


def test_te_layers_cast_their_fp8_weights_once_per_global_batch(stand_in_te):
    """Under FP8 the built-in GPT's TE layers get is_first_microbatch: True in a global batch's first forward (TE
    casts the weights into its FP8 cache), False in the others (the cache is reused), and nothing outside the
    engine's forward (TE neither fills nor reads the cache: a weight changed since is not read stale)."""
    from engine.models.gpt import GPT
    from engine.precision import forward_context

    layers = torch.nn.ModuleList([RecordingLayer(), RecordingLayer()])
    gpt = GPT(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=16, layers=layers)
    ctx = forward_context(torch.device("cpu"), train_of(fp8="hybrid"), gpt)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    for first in (True, False, False, True, False):
        with ctx(first=first):
            gpt(tokens)
    gpt(tokens)
    assert [layer.seen for layer in layers] == [[True, False, False, True, False, "unset"]] * 2
    assert gpt.first_microbatch is None
    bf16 = torch.nn.ModuleList([RecordingLayer()])
    plain = GPT(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=16, layers=bf16)
    with forward_context(torch.device("cpu"), train_of(), plain)(first=True):  # no FP8: no cache to fill
        plain(tokens)
    assert bf16[0].seen == ["unset"]


def test_the_engine_says_which_forward_is_its_global_batch_first(make_engine):
    """The engine's forward passes first=True to its precision context in the first micro-batch of each global
    batch only (the tiny config: 2 micro-batches a step)."""
    eng, _, _ = make_engine()
    real, seen = eng._autocast, []

    def recording(first=None):
        seen.append(first)
        return real(first=first)

    eng._autocast = recording
    for _ in range(2):
        eng.train_batch()
    assert seen == [True, False, True, False]


def test_the_plan_counts_the_fp8_weight_cache(gpu):
    """Under train.fp8 the plan holds each layer weight's FP8 copy and its transpose (2 B per layer parameter
    element, precision.fp8_weight_cache_bytes) on the GPU, and says activations are counted as in bf16."""
    import engine
    from engine.bench.scale import Shape
    from engine.planning.memory import FP8_NOTE

    shape = Shape(4, 256, 4, 128, 1024)
    source = {"model": {**shape.model_section(), "use_te": True}, "train": {"device": "cuda"}}
    plain = engine.plan(load_config(source), gpu_budget_bytes=80 << 30, host_budget_bytes=64 << 30)
    fp8 = engine.plan(load_config(with_train(device="cuda") | {"model": source["model"]}), gpu_budget_bytes=80 << 30,
                      host_budget_bytes=64 << 30)  # fmt: skip
    layer_elements = shape.layers * 12 * shape.hidden**2 + shape.layers * 13 * shape.hidden  # matrices, biases, norms
    assert fp8.gpu.parts["fp8_weight_cache"] == 2 * layer_elements
    assert plain.gpu.parts["fp8_weight_cache"] == 0
    assert fp8.gpu.total_bytes - plain.gpu.total_bytes >= 2 * layer_elements
    assert FP8_NOTE in fp8.notes and FP8_NOTE not in plain.notes
