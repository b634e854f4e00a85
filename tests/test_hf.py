"""HuggingFace transformers models end to end, as a user brings them: tiny random-init models built from config
classes (no download), batches written the HF way (`input_ids`, `attention_mask`, `labels`; `pixel_values` for
ViT), no `loss_fn`. Each run is compared with a hand-written `model(**batch).loss` loop over torch's AdamW:
bit for bit where the optimizer is not offloaded, 1e-5 where it is (fp32).

Shapes are chosen so activation offloading really moves something: the MLP's inner activations (micro-batch 2
x 128 positions x 128 wide x 4 bytes = 128 KiB) are above the 64 KiB threshold, the hidden states are not.
"""

from __future__ import annotations

import pytest
import torch

import engine

T = pytest.importorskip("transformers")

LR, WD, EPS = 1e-3, 0.01, 1e-5  # eps: a key bias gets only rounding noise as gradient (softmax ignores it)
STEPS, MICRO = 3, 2  # optimizer steps; micro-batches per step
SEQ, VOCAB = 128, 128
CFG = {
    "optimizer": {"lr": LR, "weight_decay": WD, "adam_eps": EPS, "clip_grad": 0.0, "lr_decay_style": "constant"},
    "train": {"train_iters": STEPS, "global_batch_size": 2 * MICRO, "micro_batch_size": 2, "precision": "fp32",
              "device": "cpu"},
    "logging": {"metrics_file": None, "progress_bar": False},
}  # fmt: skip
ACT = ["model.cpu_offloading=true"]  # + the layer count, which depends on the model
OPT = ["optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=0.5",
       "optimizer.use_distributed_optimizer=true"]  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread (conftest)


# --- the models and their batches ------------------------------------------------------------------------------
def _lm_cfg(cls, **kw):
    return cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=SEQ, **kw)  # fmt: skip


def llama(layers: int = 3):
    return T.LlamaForCausalLM(_lm_cfg(T.LlamaConfig) if layers == 3 else T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2))  # fmt: skip


def qwen2():
    return T.Qwen2ForCausalLM(_lm_cfg(T.Qwen2Config))


def qwen3():
    return T.Qwen3ForCausalLM(_lm_cfg(T.Qwen3Config, head_dim=8))


def gpt2():
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_inner=128, n_layer=3, n_head=4,
                                          n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          bos_token_id=0, eos_token_id=0))  # fmt: skip


def bert():
    return T.BertForMaskedLM(T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                          intermediate_size=128, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0))  # fmt: skip


def t5():
    # the gated-GELU feed-forward of T5 v1.1 / Flan-T5, not the original ReLU: the offloaded optimizer's fp32 steps
    # are 1e-5 from torch's only where the loss is smooth. With ReLU, one pre-activation of this seed sits ~1e-7 from
    # 0, the last-bit rounding of the C pass (fused_adamw.c) against torch's CPU AdamW moves it across after step 1,
    # relu' jumps 0 <-> 1 for that token, and Adam's normalised steps turn the changed gradients into weights 2e-5
    # apart after 3 steps (10x the tolerance); nudging 3% of the decoder's weights by 1 ulp after step 1 does the
    # same to the hand-written loop itself
    return T.T5ForConditionalGeneration(T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=128, num_layers=2,
                                                   num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                                   decoder_start_token_id=0, pad_token_id=0,
                                                   feed_forward_proj="gated-gelu"))  # fmt: skip


def vit():
    return T.ViTForImageClassification(T.ViTConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=32,
                                                   num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
                                                   num_labels=5, hidden_dropout_prob=0.0,
                                                   attention_probs_dropout_prob=0.0))  # fmt: skip


def lm_batches(n: int, seed: int = 1, seq: int = SEQ) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (2, seq), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


def mlm_batches(n: int) -> list[dict]:
    out = lm_batches(n)
    g = torch.Generator().manual_seed(2)
    for b in out:
        masked = torch.rand(b["input_ids"].shape, generator=g) < 0.15
        b["labels"] = torch.where(masked, b["input_ids"], torch.full_like(b["input_ids"], -100))
        b["input_ids"] = torch.where(masked, torch.full_like(b["input_ids"], 3), b["input_ids"])
    return out


def seq2seq_batches(n: int) -> list[dict]:
    return [{**b, "labels": t["input_ids"]} for b, t in zip(lm_batches(n), lm_batches(n, seed=3), strict=True)]


def image_batches(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(4)
    return [{"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.randint(0, 5, (2,), generator=g)}
            for _ in range(n)]  # fmt: skip


# name -> (factory, batches, layers over every stack, the MLP sub-module of a layer for fine-grained offloading)
MODELS = {
    "llama": (llama, lm_batches, 3, "mlp"),
    "qwen3": (qwen3, lm_batches, 3, "mlp"),
    "gpt2": (gpt2, lm_batches, 3, "mlp"),
    "bert": (bert, mlm_batches, 3, "intermediate"),
    "t5": (t5, seq2seq_batches, 4, "T5LayerFF"),  # encoder and decoder stacks, 2 layers each
    "vit": (vit, image_batches, 3, "mlp"),
}
MODES = {
    "plain": lambda layers, mlp: [],
    "activations": lambda layers, mlp: ACT + [f"model.cpu_offloading_num_layers={layers - 1}"],
    "optimizer": lambda layers, mlp: OPT,
    "both": lambda layers, mlp: ACT + [f"model.cpu_offloading_num_layers={layers - 1}"] + OPT,
    "mlp_only": lambda layers, mlp: [
        "model.fine_grained_activation_offloading=true",
        f'model.offload_modules=["{mlp}"]',
    ],
}


def fresh(factory, state=None):
    torch.manual_seed(0)
    model = factory()
    if state is not None:
        model.load_state_dict(state)
    return model


def reference(model, batches) -> list[float]:
    """The hand-written loop: model(**batch).loss, averaged over the micro-batches of a step, torch's AdamW."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, eps=EPS)  # fmt: skip
    losses, it = [], iter(batches)
    for _ in range(STEPS):
        total = torch.zeros(())
        for _ in range(MICRO):
            loss = model(**next(it)).loss
            (loss * (1.0 / MICRO)).backward()
            total += loss.detach().float()
        opt.step()
        opt.zero_grad()
        losses.append(total.item() / MICRO)
    return losses


def train(model, batches, overrides=(), **kw):
    eng, _, _ = engine.initialize(model=model, config=CFG, overrides=list(overrides), **kw)
    it = iter(batches)
    return eng, [eng.train_batch(it) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def references():
    """Per model: its initial weights, batches, and the reference losses and final weights (computed once)."""
    out = {}
    for name, (factory, make_batches, _, _) in MODELS.items():
        init = {k: v.clone() for k, v in fresh(factory).state_dict().items()}
        batches = make_batches(STEPS * MICRO)
        ref = fresh(factory, init)
        out[name] = (init, batches, reference(ref, batches), ref.state_dict())
    return out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_trains_as_the_hand_written_loop(name, mode, references):
    factory, _, layers, mlp = MODELS[name]
    init, batches, ref_losses, ref_weights = references[name]
    eng, losses = train(fresh(factory, init), batches, MODES[mode](layers, mlp))
    weights = eng.module.state_dict()
    if mode in ("optimizer", "both"):
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=0)
        for k, v in ref_weights.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6, msg=k)
    else:
        assert losses == ref_losses  # bit for bit
        assert all(torch.equal(weights[k], v) for k, v in ref_weights.items())
    if mode in ("activations", "both", "mlp_only"):  # something really moved, and the summary says so
        lines = eng.offload_report()
        assert any("to the host and back per step" in line for line in lines), lines


def test_qwen2_with_both_offloads(references):
    """Qwen2 (biases on q, k, v) as Qwen3 above, with activation and optimizer offload together."""
    init = {k: v.clone() for k, v in fresh(qwen2).state_dict().items()}
    batches = lm_batches(STEPS * MICRO)
    ref_losses = reference(fresh(qwen2, init), batches)
    _, losses = train(fresh(qwen2, init), batches, MODES["both"](3, "mlp"))
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=0)


# --- rules read from the model in hand -------------------------------------------------------------------------
def test_layer_count_comes_from_the_model_not_model_num_layers():
    """6 layers, 5 offloaded: the built-in GPT's default model.num_layers (4) is not consulted."""
    eng, _ = train(llama(layers=6), lm_batches(STEPS * MICRO, seq=16), ACT + ["model.cpu_offloading_num_layers=5"])
    assert len(eng.offloader.offloaded) == 5


@pytest.mark.parametrize(
    ("factory", "count", "found"),
    [(llama, 3, r"model\.layers \(3 x LlamaDecoderLayer\)"),
     (t5, 4, r"encoder\.block \(2 x T5Block\), decoder\.block \(2 x T5Block\)")],
)  # fmt: skip
def test_too_many_offloaded_layers_names_the_discovered_stacks(factory, count, found):
    message = (rf"model\.cpu_offloading_num_layers={count}: CPU offloading can be done only for layers less than "
               rf"{count} \(found {found}, counted in forward order\); "
               rf"set model\.cpu_offloading_num_layers between 0 and {count - 1}")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        engine.initialize(model=factory(), config=CFG, overrides=ACT + [f"model.cpu_offloading_num_layers={count}"])


def test_builtin_shape_keys_with_a_model_of_ones_own_are_an_error():
    with pytest.raises(engine.ConfigError) as e:
        engine.initialize(model=llama(), config=CFG, overrides=["model.num_layers=22", "model.hidden_size=2048"])
    assert str(e.value).splitlines() == [
        f"model.{k}={v}: describes the built-in GPT, and engine.initialize was given a model of its own, whose "
        f"layers and widths come from the model itself (checked after layer discovery); remove model.{k}"
        for k, v in (("num_layers", 22), ("hidden_size", 2048))
    ]
    # the same keys describe the built-in GPT when no model is passed
    engine.load_config(CFG, ["model.num_layers=22", "model.hidden_size=2048"])


def test_a_config_loaded_before_is_checked_again_for_the_model_in_hand():
    cfg = engine.load_config(CFG, ["model.num_layers=6"])
    with pytest.raises(engine.ConfigError, match=r"model\.num_layers=6: describes the built-in GPT"):
        engine.initialize(model=llama(), config=cfg)


def test_layers_path_list_picks_the_stacks():
    """Only the decoder: 1 of its 2 layers offloaded, the encoder untouched."""
    model = t5()
    eng, _, _ = engine.initialize(model=model, config=CFG, overrides=ACT + [
        "model.cpu_offloading_num_layers=1", 'model.cpu_offloading_layers_path=["decoder.block"]'])  # fmt: skip
    assert eng.offloader.offloaded == [model.decoder.block[0]]


# --- recompute and HF's gradient checkpointing -------------------------------------------------------------------
def _saved_outside_checkpoints(eng, batch) -> int:
    n = [0]

    def pack(t):
        n[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        eng.backward(eng(batch))
    return n[0]


def test_full_recompute_checkpoints_each_layer_of_a_user_model(references):
    init, batches, ref_losses, ref_weights = references["llama"]
    eng, losses = train(fresh(llama, init), batches, ["model.recompute_granularity=full"])
    assert losses == ref_losses  # recompute changes memory, not results
    assert all(torch.equal(eng.module.state_dict()[k], v) for k, v in ref_weights.items())
    plain, _ = train(fresh(llama, init), batches)
    # a checkpointed layer saves through the checkpoint's own hooks: the outer hook sees only what lies outside
    assert _saved_outside_checkpoints(eng, batches[0]) < _saved_outside_checkpoints(plain, batches[0]) / 3


def test_selective_recompute_is_refused_for_a_user_model():
    with pytest.raises(engine.ConfigError, match=r'model\.recompute_granularity="selective": selective recompute is '
                                                 r"the built-in GPT's attention core"):  # fmt: skip
        engine.initialize(model=llama(), config=CFG, overrides=["model.recompute_granularity=selective"])


def hf_checkpointing_on(model):
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


MLP_ONLY = ["model.fine_grained_activation_offloading=true", 'model.offload_modules=["mlp"]']


@pytest.mark.parametrize("overrides", [ACT + ["model.cpu_offloading_num_layers=1"], MLP_ONLY,
                                       ["model.recompute_granularity=full"]])  # fmt: skip
def test_hf_gradient_checkpointing_with_offload_or_recompute_is_refused(overrides):
    model = llama()
    hf_checkpointing_on(model)
    with pytest.raises(ValueError, match=r"the model has HF gradient checkpointing on.*gradient_checkpointing_disable"):
        engine.initialize(model=model, config=CFG, overrides=overrides)


def test_hf_gradient_checkpointing_with_optimizer_offload_trains(references):
    init, batches, ref_losses, _ = references["llama"]
    model = fresh(llama, init)
    hf_checkpointing_on(model)
    _, losses = train(model, batches, OPT)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=0)


# --- how the batch and the output meet the engine --------------------------------------------------------------
def test_loss_fn_gets_the_output_and_the_labels_which_stay_out_of_the_model(references):
    init, batches, ref_losses, _ = references["llama"]
    seen = []

    def loss_fn(out, labels):  # the model's own loss, from its logits: labels did not reach it (loss is None)
        seen.append((labels, out.loss))
        logits = out.logits.float()[:, :-1].flatten(0, 1)
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten())

    _, losses = train(fresh(llama, init), batches, loss_fn=loss_fn)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert torch.equal(seen[0][0], batches[0]["labels"]) and all(loss is None for _, loss in seen)


def test_tuple_batches_pass_labels_to_hf_models(references):
    init, batches, ref_losses, _ = references["llama"]
    _, losses = train(fresh(llama, init), [(b["input_ids"], b["labels"]) for b in batches])
    assert losses == ref_losses


def test_an_output_without_a_loss_says_what_came_back():
    eng, _, _ = engine.initialize(model=llama(), config=CFG)
    batch = {k: v for k, v in lm_batches(1)[0].items() if k != "labels"}
    with pytest.raises(ValueError, match=r"the model returned CausalLMOutputWithPast with loss=None \(the batch has no "
                                         r"`labels` for the model to compute it from\); pass loss_fn="):  # fmt: skip
        eng(batch)
    with pytest.raises(ValueError, match=r"loss_fn returned a tensor of shape \[2, 128, 128\].*not a floating-point "
                                         r"scalar loss"):  # fmt: skip
        engine.initialize(model=llama(), config=CFG, loss_fn=lambda out, labels: out.logits)[0](lm_batches(1)[0])


class TorchViT(torch.nn.Module):
    """A ViT on torch's own TransformerEncoder, which (unlike HF's ViT) does not cast its input to its weights."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = torch.nn.Conv2d(3, 32, kernel_size=8, stride=8)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.encoder(self.patches(pixel_values).flatten(2).transpose(1, 2))
        return torch.nn.functional.cross_entropy(self.head(x.mean(1)).float(), labels)


def test_half_weights_take_float_inputs():
    """float32 pixel_values meet bf16 weights: cast to bf16 on the way in; integer labels are left alone."""
    seen = []
    model = TorchViT()
    model.patches.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    eng, losses = train(model, image_batches(STEPS * MICRO), ["train.params_dtype=half", "train.precision=bf16"])
    # one forward more: the memory plan's, of the first micro-batch (engine.first_batch)
    assert model.patches.weight.dtype == torch.bfloat16 and seen == [torch.bfloat16] * (STEPS * MICRO + 1)
    assert all(torch.isfinite(torch.tensor(losses)))


# --- checkpoints ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "t5"])
def test_resume_is_exact_with_both_offloads(name, tmp_path, references):
    factory, _, layers, mlp = MODELS[name]
    init, batches, _, _ = references[name]
    overrides = MODES["both"](layers, mlp) + ["train.train_iters=4"]
    more = batches + batches[:2]  # 4 steps of 2 micro-batches from 6 micro-batches: the first two again
    eng, _, _ = engine.initialize(model=fresh(factory, init), config=CFG, overrides=overrides)
    it = iter(more)
    eng.train_batch(it), eng.train_batch(it)
    eng.save_checkpoint(str(tmp_path))
    straight = [eng.train_batch(it), eng.train_batch(it)]
    back, _, _ = engine.initialize(model=fresh(factory), config=CFG, overrides=overrides)  # other initial weights
    back.load_checkpoint(str(tmp_path))
    it = iter(more[4:])
    assert [back.train_batch(it), back.train_batch(it)] == straight
    assert all(torch.equal(v, back.module.state_dict()[k]) for k, v in eng.module.state_dict().items())


@pytest.mark.parametrize("name", ["llama", "gpt2"])  # gpt2: its output embedding is tied to the input's
def test_save_pretrained_round_trip(name, tmp_path, references):
    factory, _, layers, mlp = MODELS[name]
    init, batches, _, _ = references[name]
    eng, _ = train(fresh(factory, init), batches, MODES["both"](layers, mlp))
    eng.save_pretrained(str(tmp_path))
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "config.json").exists()
    loaded = type(eng.module).from_pretrained(str(tmp_path))
    mine = eng.module.state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in loaded.state_dict().items())
    with torch.no_grad():
        assert torch.equal(loaded(**batches[0]).loss, eng.module(**batches[0]).loss)


def test_save_pretrained_needs_a_pretrained_model(tmp_path):
    eng, _, _ = engine.initialize(config={**CFG, "model": {"num_layers": 2, "hidden_size": 32}})
    with pytest.raises(ValueError, match="save_pretrained needs a transformers PreTrainedModel.*GPT has none: use "
                                         r"eng\.save_checkpoint"):  # fmt: skip
        eng.save_pretrained(str(tmp_path))


# --- what offloading did, in words ---------------------------------------------------------------------------------
def test_report_names_each_stack_and_what_moved(references):
    init, batches, _, _ = references["t5"]
    eng, _ = train(fresh(t5, init), batches, MODES["both"](4, "T5LayerFF"))
    enc, dec, opt = eng.offload_report()
    assert enc.startswith("activation offload encoder.block: 2 of 2 layers wrapped: ")
    assert dec.startswith("activation offload decoder.block: 1 of 2 layers wrapped: ")
    s = eng.offloader.session
    per_step = sum(s.moved_bytes[u] / s.calls[u] for u in range(3)) * MICRO
    from engine.metrics import format_bytes

    assert f"{format_bytes(sum(s.moved_bytes[u] / s.calls[u] for u in range(2)) * MICRO)} to the host" in enc
    assert per_step > 0 and "off the GPU by the end of forward" in dec
    assert opt.startswith("optimizer offload: ") and "stepped on the CPU" in opt


def test_report_says_when_wrapped_layers_moved_nothing():
    """A tiny model: every saved tensor is under the 64 KiB threshold, so nothing is offloaded; the report says so."""
    eng, _ = train(llama(), lm_batches(STEPS * MICRO, seq=8), ACT + ["model.cpu_offloading_num_layers=2"])
    (line,) = eng.offload_report()
    assert line.startswith("activation offload model.layers: 2 of 3 layers wrapped, but nothing moved: each saved "
                           "tensor (")  # fmt: skip
    assert "is at most 65536 bytes" in line


# --- weights readable right after a step ------------------------------------------------------------------------
def test_state_dict_right_after_train_batch_sees_the_updated_weights():
    """Optimizer offload with overlap: the CPU-stepped layers' updates land after train_batch returns. A read right
    then (state_dict(), eng.module, a forward outside the engine) must see them: equal to what the same weights
    hold once eng.synchronize() returned."""
    # a large vocabulary, so the CPU step (its embeddings and head) takes longer than the engine's return
    model = T.LlamaForCausalLM(
        T.LlamaConfig(
            vocab_size=32000,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    batches = lm_batches(6, seq=16)
    eng, _, _ = engine.initialize(model=model, config=CFG,
                                  overrides=OPT + ["optimizer.overlap_cpu_optimizer_d2h_h2d=true",
                                                   "optimizer.optimizer_offload_fraction=0.9"])  # fmt: skip
    cpu_stepped = sorted(eng.optimizer.inner.cpu_names if hasattr(eng.optimizer, "inner") else eng.optimizer.cpu_names)
    assert cpu_stepped
    params = dict(eng._module.named_parameters())  # raw references: these alone do not wait (documented)

    def through_state_dict():
        return {n: t.clone() for n, t in eng._module.state_dict().items() if n in cpu_stepped}

    def through_eng_module():
        return {n: p.detach().clone() for n, p in eng.module.named_parameters() if n in cpu_stepped}

    def after_a_forward_outside_the_engine():
        with torch.no_grad():
            eng._module(input_ids=batches[0]["input_ids"])
        return {n: params[n].detach().clone() for n in cpu_stepped}

    reads = [through_state_dict, through_eng_module, after_a_forward_outside_the_engine]
    for step in range(24):
        eng.train_batch(iter(batches[(2 * step) % 6 : (2 * step) % 6 + 2]))
        seen = reads[step % len(reads)]()
        eng.synchronize()
        for n in cpu_stepped:
            how = reads[step % len(reads)].__name__
            assert torch.equal(seen[n], params[n]), f"step {step}, {how}: {n} read too early"


def test_a_tensor_output_that_is_not_a_loss_says_so():
    """Regression output [b, 1] with float targets: no default loss applies (cross-entropy wants class ids)."""
    eng, _, _ = engine.initialize(model=torch.nn.Linear(4, 1), config=CFG)
    nor_logits = r"not a scalar loss, nor logits \[\.\.\., classes\] for the integer labels of shape \[2\]"
    with pytest.raises(ValueError, match=r"the model returned a tensor of shape \[2, 1\]: " + nor_logits):
        eng((torch.randn(2, 4), torch.randn(2)))
    with pytest.raises(ValueError, match=r"the model returned a tensor of shape \[2, 1\]: not a scalar loss, and no "
                                         r"labels came; pass loss_fn="):  # fmt: skip
        eng(torch.randn(2, 4))


def test_a_deepcopy_of_a_recomputed_model_runs_its_own_weights():
    """An EMA copy made with deepcopy: its recomputed layers must compute with the copy's weights."""
    import copy

    eng, _, _ = engine.initialize(model=llama(), config=CFG, overrides=["model.recompute_granularity=full"])
    twin = copy.deepcopy(eng.module)
    with torch.no_grad():
        for p in twin.model.layers.parameters():
            p.zero_()
    batch = lm_batches(1, seq=16)[0]
    assert not torch.equal(twin(**batch).loss, eng.module(**batch).loss)
    loss = twin(**batch).loss  # with gradients: through the checkpoint
    loss.backward()
    assert twin.model.layers[0].mlp.down_proj.weight.grad is not None
    assert eng.module.model.layers[0].mlp.down_proj.weight.grad is None


def test_the_built_in_gpt_passed_in_must_agree_with_its_keys():
    from engine.models.gpt import GPT

    def gpt():
        return GPT(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=256)

    shape = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2"]
    engine.initialize(model=gpt(), config=CFG, overrides=shape)  # they describe it: accepted
    with pytest.raises(engine.ConfigError, match=r"^model\.num_layers=3: the GPT passed to engine\.initialize has "
                                                 r"num_layers 2; set model\.num_layers=2 or remove it$"):  # fmt: skip
        engine.initialize(model=gpt(), config=CFG, overrides=["model.num_layers=3"])
