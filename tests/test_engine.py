"""The Engine's step against hand-written references: accumulation, loop API, precision, schedule."""

import pytest
import torch

import engine
from engine.models.gpt import gpt_loss


def test_initialize_returns_engine_optimizer_scheduler(make_engine):
    eng, opt, sched = make_engine()
    assert isinstance(eng, engine.Engine)
    assert opt is eng.optimizer and sched is eng.lr_scheduler
    assert eng.micro_batches_per_step == 2


def test_train_batch_equals_hand_written_loop(make_engine):
    a, _, _ = make_engine()
    b, _, _ = make_engine()
    for _ in range(3):
        la = a.train_batch()
        it = b._data(None)
        losses = []
        for _ in range(b.micro_batches_per_step):
            loss = b(next(it))
            b.backward(loss)
            losses.append(loss.item())
        assert b.step() is True  # the last micro-batch of the global batch steps
        assert la == pytest.approx(sum(losses) / len(losses), rel=0, abs=1e-6)
    for pa, pb in zip(a.module.parameters(), b.module.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_step_only_at_accumulation_boundary(make_engine):
    eng, _, _ = make_engine()
    it = eng._data(None)
    eng.backward(eng(next(it)))
    before = [p.detach().clone() for p in eng.module.parameters()]
    assert eng.step() is False
    assert all(torch.equal(a, p) for a, p in zip(before, eng.module.parameters(), strict=True))
    eng.backward(eng(next(it)))
    assert eng.step() is True
    assert eng.iteration == 1


def test_accumulation_matches_one_big_batch(make_engine):
    """Two micro-batches of 2 must give the gradient of one batch of 4 (the mean over sequences)."""
    acc, _, _ = make_engine(["train.global_batch_size=4", "train.micro_batch_size=2", "optimizer.clip_grad=0"])
    big, _, _ = make_engine(["train.global_batch_size=4", "train.micro_batch_size=4", "optimizer.clip_grad=0"])
    it = acc._data(None)
    b1, b2 = next(it), next(it)
    acc.backward(acc(b1))
    acc.backward(acc(b2))
    big.backward(big((torch.cat([b1[0], b2[0]]), torch.cat([b1[1], b2[1]]))))
    for pa, pb in zip(acc.module.parameters(), big.module.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-7)


def test_matches_plain_torch_adamw_with_clipping_and_schedule(make_engine):
    # eps 1e-5: the attention key bias gets only rounding noise as gradient, which Adam at eps 1e-8 turns
    # into full-size steps whose sign any reordering of a sum flips
    eng, _, _ = make_engine(["train.train_iters=5", "optimizer.adam_eps=1e-5"])
    torch.manual_seed(eng.config.train.seed)
    ref = engine.build.build_model(eng.config.model, torch.device("cpu"), 0)
    ref.load_state_dict(eng.module.state_dict())
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    rest = [p for p in ref.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-3, eps=1e-5
    )
    lrs = [1e-3 * 1 / 2, 1e-3 * 2 / 2, 1e-3 * (1 - 1 / 3), 1e-3 * (1 - 2 / 3), 0.0]  # warmup 2, linear to 5
    used = []
    data = eng._data(None)
    batches = [[next(data) for _ in range(2)] for _ in range(5)]
    for _step, pair in enumerate(batches):
        used.append(eng.optimizer.param_groups[0]["lr"])
        eng.train_batch(iter(pair))
        for g in opt.param_groups:
            g["lr"] = used[-1]
        for x, y in pair:
            (gpt_loss(ref(x), y) / 2).backward()
        torch.nn.utils.clip_grad_norm_(decay + rest, 1.0, foreach=True)  # the engine's group order
        opt.step()
        opt.zero_grad()
    for (name, p), q in zip(eng.module.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    assert used == pytest.approx(lrs, rel=1e-12)


def test_loss_decreases_on_default_data(make_engine):
    eng, _, _ = make_engine(
        [
            "train.global_batch_size=8",
            "train.micro_batch_size=8",
            "optimizer.lr=3e-3",
            "train.train_iters=15",
            "optimizer.lr_decay_style=constant",
        ]
    )
    losses = [eng.train_batch() for _ in range(15)]
    assert losses[-1] < losses[0] * 0.8


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_precisions_train(precision, make_engine):
    eng, _, _ = make_engine([f"train.precision={precision}"])
    losses = [eng.train_batch() for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert eng.module.layers[0].mlp.fc1.weight.dtype == torch.float32


def test_fp16_overflow_skips_step_and_halves_scale(make_engine):
    eng, _, _ = make_engine(["train.precision=fp16"])
    it = eng._data(None)
    before = [p.detach().clone() for p in eng.module.parameters()]
    scale = eng.scaler.scale
    for _ in range(2):
        eng.backward(eng(next(it)) * float("inf"))
    assert eng.step() is False
    assert eng.last_step_skipped and eng.scaler.scale == scale / 2
    assert all(torch.equal(a, p) for a, p in zip(before, eng.module.parameters(), strict=True))


def test_user_model_and_optimizer_with_own_loss(tiny_config):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng, o, _ = engine.initialize(
        model=model,
        optimizer=opt,
        config={**tiny_config, "model": {}},  # a model of one's own: the built-in GPT's shape keys are refused
        loss_fn=torch.nn.functional.mse_loss,
        overrides=["optimizer.lr_warmup_iters=0", "optimizer.lr_decay_style=constant"],
    )
    assert o is opt
    x, y = torch.randn(2, 4), torch.randn(2, 1)
    first = eng.train_batch(iter([(x, y), (x, y)]))
    for _ in range(20):
        last = eng.train_batch(iter([(x, y), (x, y)]))
    assert last < first


def test_schedule_warmup_then_decay(make_engine):
    eng, opt, _ = make_engine(
        [
            "optimizer.lr_warmup_iters=2",
            "optimizer.lr_decay_style=cosine",
            "optimizer.min_lr=1e-4",
            "train.train_iters=4",
        ]
    )
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        eng.train_batch()
    assert seen[:3] == pytest.approx([5e-4, 1e-3, 1e-4 + 0.9e-3 * 0.5])
    assert seen[3:] == pytest.approx([1e-4, 1e-4])


def test_user_optimizer_cannot_take_half_weights(tiny_config):
    model = torch.nn.Linear(4, 1)
    with pytest.raises(ValueError, match='train.params_dtype="half" keeps fp32 master weights'):
        engine.initialize(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            config={**tiny_config, "model": {}},  # a model of one's own: the built-in GPT's shape keys are refused
            overrides=["train.params_dtype=half", "train.precision=bf16"],
        )


def test_gpt_keeps_the_weights_of_blocks_built_elsewhere():
    """model.use_te hands GPT Transformer Engine's blocks, which initialise themselves: the name-based init
    (zero biases, ones for norm weights) must leave them as built, and still init GPT's own parameters."""
    from torch import nn

    from engine.models.gpt import GPT, TransformerLayer

    blocks = nn.ModuleList(TransformerLayer(16, 2, 64) for _ in range(2))
    with torch.no_grad():
        for p in blocks.parameters():
            p.fill_(0.5)
    gpt = GPT(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=32, layers=blocks)
    assert gpt.layers is blocks
    assert all(torch.all(p == 0.5) for p in blocks.parameters())
    assert torch.all(gpt.final_norm.weight == 1) and gpt.embedding.weight.std() > 0


def test_one_parameter_grouping_for_every_optimizer():
    """Matrices decay; biases (whatever their shape), norm weights and scalars do not; megatron's grouping is the
    same function with bare tensors."""
    from torch import nn

    from engine.megatron.optimizer import megatron_param_groups
    from engine.optim.param_groups import named_parameter_groups

    m = nn.Module()
    m.w, m.norm, m.scale = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(()))
    m.bias = nn.Parameter(torch.ones(2, 2))  # a 2-D bias, as some attention layers hold
    named = named_parameter_groups(m, None, 0.1)
    assert [[n for n, _ in g["params"]] for g in named] == [["w"], ["norm", "scale", "bias"]]
    assert [g["weight_decay"] for g in named] == [0.1, 0.0]
    bare = megatron_param_groups(m, 0.1)
    assert [[id(p) for p in g["params"]] for g in bare] == [[id(p) for _, p in g["params"]] for g in named]
