"""A model of one's own given without example_batch is planned at its first micro-batch: measured there, refused
there with the plan's one line, "auto" chosen there, and only then is the optimizer's state allocated. What reads
the optimizer before works (built at once) or says what is needed; a checkpoint loaded before is applied once the
optimizer exists."""

from __future__ import annotations

import pytest
import torch

import engine
from engine import first_batch
from engine.config import ConfigError
from engine.planning import budget, preflight
from engine.planning.batch import describe
from engine.planning.oom import PlannedOutOfMemoryError

transformers = pytest.importorskip("transformers")
SEQ = 64
AUTO = {"optimizer": {"optimizer_cpu_offload": True, "use_distributed_optimizer": True,
                      "optimizer_offload_fraction": "auto"},
        "model": {"cpu_offloading": True, "cpu_offloading_num_layers": "auto"}}  # fmt: skip


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512))  # fmt: skip


def batches(n: int, seq: int = SEQ) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 1000, (2, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def config(extra: dict | None = None) -> dict:
    cfg = {"train": {"micro_batch_size": 2, "global_batch_size": 4, "device": "cpu", "precision": "fp32",
                     "train_iters": 4, "seed": 3},
           "optimizer": {"lr": 1e-3, "lr_warmup_iters": 0, "lr_decay_style": "constant"},
           "logging": {"metrics_file": None, "progress_bar": False}}  # fmt: skip
    for section, keys in (extra or {}).items():
        cfg[section] = {**cfg.get(section, {}), **keys}
    return cfg


@pytest.fixture
def events(monkeypatch):
    """The order of the pre-flight (with the batch it measured) and the optimizer's construction."""
    seen: list = []
    check, build = preflight.check, first_batch.optimizer_for

    def spy_check(cfg, model, device, world, budgets=None, example_batch=None, loss_fn=None, **kw):
        seen.append(("plan", example_batch))
        return check(cfg, model, device, world, budgets, example_batch, loss_fn, **kw)

    def spy_build(*args):
        seen.append(("optimizer", None))
        return build(*args)

    monkeypatch.setattr(preflight, "check", spy_check)
    monkeypatch.setattr(first_batch, "optimizer_for", spy_build)
    return seen


def test_auto_is_chosen_at_the_first_micro_batch_before_the_optimizer_exists(events):
    data = batches(4)
    budgets = budget.Budgets(host_bytes=8 << 30)
    eng, optimizer, scheduler = engine.initialize(model=llama(), config=config(AUTO), memory_budgets=budgets)
    assert events == [] and eng.config.optimizer.optimizer_offload_fraction == "auto"
    assert isinstance(optimizer, first_batch.Deferred) and eng.host_bytes() == 0
    it = iter(data)
    losses = [eng.train_batch(it), eng.train_batch(it)]
    assert events == [("plan", data[0]), ("optimizer", None)]  # that micro-batch, measured before the build
    cfg, plan = eng.planned
    assert plan.batch_seen and plan.fits  # the source line says what it measured: that micro-batch, and its shape
    assert plan.activations_source.startswith(f"measured at the first micro-batch, shape {describe(data[0])}, on cpu")
    assert cfg is eng.config and isinstance(eng.config.optimizer.optimizer_offload_fraction, float)
    assert optimizer.param_groups is first_batch.raw(eng.optimizer).param_groups and scheduler.last_epoch == 2
    # the same choice, plan and training as with that micro-batch given to initialize
    ref, _, _ = engine.initialize(model=llama(), config=config(AUTO), example_batch=data[0], memory_budgets=budgets)
    it = iter(data)
    assert [ref.train_batch(it), ref.train_batch(it)] == losses
    given, first = ref.planned[1].to_json(), plan.to_json()
    assert given["activations"].pop("source") == first["activations"].pop("source").replace(
        "first micro-batch", "example batch"
    )
    assert ref.config == eng.config and given == first


def test_a_first_micro_batch_that_does_not_fit_is_refused_before_the_optimizer_is_built(events):
    model, data = llama(), batches(1, seq=256)
    # the host budget holds the weights and the optimizer, not the logits of 2 x 256 tokens over 1000 classes
    without = engine.plan(config(), model, device="cpu")
    budgets = budget.Budgets(host_bytes=without.host.total_bytes + (1 << 20))
    eng, _, _ = engine.initialize(model=model, config=config(), memory_budgets=budgets)
    with pytest.raises(ConfigError, match=r"host memory: plan needs [0-9.]+ GiB, [0-9.]+ GiB available") as e:
        eng.train_batch(iter(data))
    assert "\n" not in str(e.value)
    assert events == [("plan", None), ("plan", data[0])]  # at initialize without activations, then the batch
    assert eng._optimizer is None and eng.iteration == 0


def test_without_auto_reading_the_optimizer_builds_it_and_the_first_micro_batch_is_still_checked(events):
    eng, optimizer, scheduler = engine.initialize(model=llama(), config=config())
    assert optimizer.param_groups[0]["lr"] == 1e-3 and scheduler.get_last_lr() == [1e-3, 1e-3]
    assert events == [("plan", None), ("plan", None), ("optimizer", None)]
    assert not eng.planned or not eng.planned[1].batch_seen
    data = batches(1)
    eng.train_batch(iter(data * 2))
    assert events[-1] == ("plan", data[0]) and eng.planned[1].batch_seen
    assert [e for e, _ in events].count("optimizer") == 1  # built once


@pytest.mark.parametrize("read", ["eng.optimizer", "optimizer", "scheduler", "save_checkpoint"])
def test_with_auto_reading_the_optimizer_first_says_what_is_needed(read, tmp_path):
    eng, optimizer, scheduler = engine.initialize(model=llama(), config=config(AUTO))
    reads = {
        "eng.optimizer": lambda: eng.optimizer,
        "optimizer": lambda: optimizer.param_groups,
        "scheduler": lambda: scheduler.get_last_lr(),
        "save_checkpoint": lambda: eng.save_checkpoint(tmp_path),
    }
    with pytest.raises(
        ValueError,
        match=r"is built at the first micro-batch: optimizer\.optimizer_offload_fraction="
        r'"auto" and model\.cpu_offloading_num_layers="auto" are chosen by the memory '
        r"plan of that micro-batch; call eng.train_batch first, pass example_batch=",
    ):
        reads[read]()  # fmt: skip


def test_a_checkpoint_loaded_before_the_first_micro_batch_is_applied_once_the_optimizer_exists(tmp_path):
    data = batches(6)
    first, _, _ = engine.initialize(model=llama(), config=config(AUTO), example_batch=data[0])
    it = iter(data)
    first.train_batch(it)
    first.save_checkpoint(str(tmp_path))
    expected = first.train_batch(it)
    resumed, _, _ = engine.initialize(model=llama(), config=config(AUTO))
    resumed.load_checkpoint(str(tmp_path))
    assert resumed._optimizer is None and resumed.iteration == 1
    assert resumed.train_batch(iter(data[2:])) == expected
    for (name, a), b in zip(first.module.state_dict().items(), resumed.module.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_out_of_memory_in_the_plans_forward_of_the_first_micro_batch_is_one_line(monkeypatch):
    model = llama()
    eng, _, _ = engine.initialize(model=model, config=config(AUTO))

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ...")

    monkeypatch.setattr(model.model.layers[2].mlp, "forward", oom)
    with pytest.raises(PlannedOutOfMemoryError, match=r"^CUDA out of memory in the memory plan's forward of the first "
                                                      r"micro-batch: allocating 2\.00 GiB failed, which holds one "
                                                      r"layer's activations at a time; lower train\.micro_batch_size "
                                                      r"\(now 2\)"):  # fmt: skip
        eng.train_batch(iter(batches(2)))
    assert eng._optimizer is None


def test_an_auto_number_of_recomputed_layers_is_chosen_there_too():
    data, budgets = batches(2), budget.Budgets(host_bytes=8 << 30)
    auto = {**AUTO, "model": {**AUTO["model"], "recompute_granularity": "full", "recompute_num_layers": "auto"}}
    eng, _, _ = engine.initialize(model=llama(), config=config(auto), memory_budgets=budgets)
    assert eng.config.model.recompute_num_layers == "auto"
    loss = eng.train_batch(iter(data))
    ref, _, _ = engine.initialize(model=llama(), config=config(auto), example_batch=data[0], memory_budgets=budgets)
    assert isinstance(eng.config.model.recompute_num_layers, int) and ref.config == eng.config
    assert ref.train_batch(iter(data)) == loss
