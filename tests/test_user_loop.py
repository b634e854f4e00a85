"""A user's own loop meets the engine: the data iterator, where labels go, a torch criterion as loss_fn, and an
out-of-memory error as one line. Tiny HF models built from config classes (no download), on CPU."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import engine
from engine.batch import takes_labels
from engine.planning.oom import PlannedOutOfMemoryError

T = pytest.importorskip("transformers")

CFG = {
    "optimizer": {"lr": 1e-3, "clip_grad": 0.0, "lr_warmup_iters": 0, "lr_decay_style": "constant"},
    "train": {"train_iters": 3, "global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32", "device": "cpu"},
    "logging": {"metrics_file": None, "progress_bar": False},
}  # fmt: skip
VOCAB, SEQ = 64, 16


def llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return T.LlamaForCausalLM(cfg)


def classifier(seed: int = 0):
    torch.manual_seed(seed)
    return T.LlamaForSequenceClassification(T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_labels=5, pad_token_id=0))  # fmt: skip


def lm_batches(n: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (2, SEQ), generator=g)
        labels = ids.clone()
        labels[0, -4:] = -100  # padding the loss ignores
        out.append({"input_ids": ids, "labels": labels})
    return out


def hand_loop(model, batches, steps: int, loss=lambda model, b: model(**b).loss) -> list[float]:
    """model(**batch).loss over two micro-batches a step, torch's AdamW with the engine's defaults."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.999), eps=1e-8)  # fmt: skip
    out, it = [], iter(batches)
    for _ in range(steps):
        total = 0.0
        for _ in range(2):
            value = loss(model, next(it))
            (value / 2).backward()
            total += value.item()
        opt.step()
        opt.zero_grad()
        out.append(total / 2)
    return out


def engine_losses(model, batches, steps: int, **kw) -> list[float]:
    eng, _, _ = engine.initialize(model=model, config=CFG, **kw)
    it = iter(batches)
    return [eng.train_batch(it) for _ in range(steps)]


# --- the data iterator -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [list, tuple, lambda b: torch.utils.data.DataLoader(b, batch_size=None)])
def test_train_batch_refuses_an_iterable_that_each_call_would_restart(make):
    eng, _, _ = engine.initialize(model=llama(), config=CFG)
    batches = make(lm_batches(4))
    with pytest.raises(TypeError, match=r"^train_batch\(data_iter\) takes an iterator, as DeepSpeed's does, and was "
                                        r"given a \w+, which each call would restart from its first batch; create "
                                        r"it = iter\(batches\) once"):  # fmt: skip
        eng.train_batch(batches)
    assert eng.iteration == 0 and eng.micro_step == 0  # refused before any batch ran


def test_train_batch_takes_the_same_iterator_across_calls():
    batches = lm_batches(6)
    assert engine_losses(llama(), batches, 3) == pytest.approx(hand_loop(llama(), batches, 3), rel=1e-6)


# --- where labels go ---------------------------------------------------------------------------------------------
class KwargsWrapper(nn.Module):
    """A user's wrapper that forwards everything: `forward(**kw)`."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kw):
        return self.inner(**kw)


def test_labels_reach_a_kwargs_forward():
    batches = lm_batches(4)
    ref = hand_loop(llama(), batches, 2)
    assert engine_losses(KwargsWrapper(llama()), batches, 2) == pytest.approx(ref, rel=1e-6)


def test_labels_passed_on_to_a_forward_without_them_is_one_line():
    class Drops(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, **kw):
            return self.inner(**kw)

        def inner(self, x):
            return self.lin(x).sum()

    eng, _, _ = engine.initialize(model=Drops(), config=CFG)
    with pytest.raises(TypeError, match=r"^the model's forward takes \*\*kwargs, so the batch's `labels` were passed "
                                        r"to it, and inside it .*unexpected keyword argument 'labels'.*; pass labels "
                                        r"on to a forward that takes them, or pass loss_fn="):  # fmt: skip
        eng({"x": torch.randn(2, 4), "labels": torch.zeros(2)})


def test_labels_are_seen_through_torch_compile():
    model = llama()
    compiled = torch.compile(model, backend="eager")
    assert "labels" not in inspect.signature(compiled.forward).parameters  # what a plain look would see
    assert takes_labels(compiled)
    plain = torch.compile(nn.Linear(4, 4), backend="eager")  # forward(input): labels cannot go in
    assert not takes_labels(plain)


def test_compiled_model_trains_with_its_own_loss():
    batches = lm_batches(4)
    ref = hand_loop(llama(), batches, 2)
    assert engine_losses(torch.compile(llama(), backend="eager"), batches, 2) == pytest.approx(ref, rel=1e-5)


def test_with_a_loss_fn_labels_stay_out_of_the_model():
    """The model would compute a second loss from them, thrown away: it must not see them."""
    model, seen = llama(), []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(sorted(kwargs)), with_kwargs=True)

    def loss_fn(out, labels):
        assert out.loss is None
        return nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())

    batches = lm_batches(4)
    ref = hand_loop(llama(), batches, 2)
    assert engine_losses(model, batches, 2, loss_fn=loss_fn) == pytest.approx(ref, rel=1e-5)
    assert seen and all(keys == ["input_ids"] for keys in seen), seen


# --- a torch criterion as loss_fn ------------------------------------------------------------------------------
@pytest.mark.parametrize("criterion", [nn.CrossEntropyLoss(), nn.functional.cross_entropy])
def test_a_torch_criterion_gets_a_classifiers_logits(criterion):
    g = torch.Generator().manual_seed(3)
    batches = [{"input_ids": torch.randint(1, VOCAB, (2, SEQ), generator=g), "labels": torch.randint(0, 5, (2,),
               generator=g)} for _ in range(4)]  # fmt: skip

    def own(model, b):
        return nn.functional.cross_entropy(model(input_ids=b["input_ids"]).logits, b["labels"])

    ref = hand_loop(classifier(), batches, 2, own)
    assert engine_losses(classifier(), batches, 2, loss_fn=criterion) == pytest.approx(ref, rel=1e-5)


def test_a_torch_criterion_on_a_causal_lm_is_the_models_own_loss():
    """Labels are the input ids: the criterion sees position t's logits against token t+1, as the model's loss."""
    batches = lm_batches(4)
    ref = hand_loop(llama(), batches, 2)
    assert engine_losses(llama(), batches, 2, loss_fn=nn.CrossEntropyLoss()) == pytest.approx(ref, rel=1e-5)


def test_a_loss_fn_that_takes_the_output_for_logits_names_them():
    eng, _, _ = engine.initialize(model=classifier(), config=CFG,
                                  loss_fn=lambda out, y: nn.functional.cross_entropy(out, y))  # fmt: skip
    with pytest.raises(TypeError, match=r"^loss_fn\(output, labels\) got the model's SequenceClassifierOutputWithPast "
                                        r"and failed \(.*\); its logits are output\.logits"):  # fmt: skip
        eng({"input_ids": torch.ones(2, SEQ, dtype=torch.long), "labels": torch.zeros(2, dtype=torch.long)})


# --- out of memory ---------------------------------------------------------------------------------------------
TORCH_OOM = "CUDA out of memory. Tried to allocate 4.64 GiB. GPU 0 has a total capacity of 139.81 GiB ..."


def _raise_oom(*args, **kwargs):
    raise torch.OutOfMemoryError(TORCH_OOM)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_in_train_batch_is_one_line_naming_the_plan(where):
    model = llama()
    eng, _, _ = engine.initialize(model=model, config=CFG, example_batch=lm_batches(1)[0])  # planned now
    if where == "forward":
        model.model.layers[1].mlp.forward = _raise_oom
    else:
        model.model.layers[1].mlp.register_full_backward_hook(lambda *a: _raise_oom())
    with pytest.raises(torch.OutOfMemoryError) as e:
        eng.train_batch(iter(lm_batches(2)))
    assert isinstance(e.value, PlannedOutOfMemoryError) and isinstance(e.value.__cause__, torch.OutOfMemoryError)
    line = str(e.value)
    assert "\n" not in line
    cfg, plan = eng.planned
    assert line.startswith(f"CUDA out of memory in {where}: allocating 4.64 GiB failed where the plan said "
                           f"{plan.gpu.total_bytes / 2**30:.1f} GiB of ")  # fmt: skip
    assert line.endswith("raise optimizer.optimizer_offload_fraction (now 0.00) or model.cpu_offloading_num_layers "
                         "(now 0), or lower train.micro_batch_size (now 2)")  # fmt: skip


def test_out_of_memory_without_a_plan_says_so():
    model = llama()
    eng, _, _ = engine.initialize(model=model, config=CFG, example_batch=lm_batches(1)[0])
    eng.planned = None  # an Engine built by hand, without the pre-flight
    model.model.layers[0].mlp.forward = _raise_oom
    with pytest.raises(PlannedOutOfMemoryError, match=r"^CUDA out of memory in forward: allocating 4\.64 GiB failed; "
                                                      r"no memory plan was made"):  # fmt: skip
        eng.train_batch(iter(lm_batches(2)))


# --- the built-in GPT's shape keys with a model of one's own ------------------------------------------------------
@pytest.mark.parametrize("how", ["overrides", "dict", "loaded"])
def test_builtin_shape_keys_are_refused_when_written_even_at_their_defaults(how):
    defaults = ["model.num_layers=4", "model.hidden_size=128"]  # the schema's defaults: still not this model's
    config, overrides = CFG, defaults
    if how == "dict":
        config, overrides = {**CFG, "model": {"num_layers": 4, "hidden_size": 128}}, []
    if how == "loaded":
        config, overrides = engine.load_config(CFG, defaults), []
    with pytest.raises(engine.ConfigError) as e:
        engine.initialize(model=llama(), config=config, overrides=overrides)
    assert [line.split(":")[0] for line in str(e.value).splitlines()] == ["model.num_layers=4", "model.hidden_size=128"]
    assert all(line.endswith("; remove model." + line.split("=")[0][6:]) for line in str(e.value).splitlines())
    engine.initialize(model=llama(), config=engine.load_config(CFG))  # a loaded config without them: accepted
