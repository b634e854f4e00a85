"""Fused linear cross-entropy (model.fused_linear_cross_entropy): the same loss and gradients as the HF model's own
loss, over chunks of tokens, for tiny Llama, Qwen2 and GPT-2 (tied head) with -100 labels and padding."""

from __future__ import annotations

import pytest
import torch
from peak_bytes import PeakBytes

import engine
from engine.models.linear_cross_entropy import chunk_bytes, fused_linear_cross_entropy, fused_linear_cross_entropy_bytes

T = pytest.importorskip("transformers")
VOCAB, SEQ = 97, 24
CFG = {
    "optimizer": {"lr": 1e-3, "adam_eps": 1e-5, "clip_grad": 0.0, "lr_warmup_iters": 0, "lr_decay_style": "constant"},
    "train": {"train_iters": 2, "global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32", "device": "cpu"},
    "logging": {"metrics_file": None, "progress_bar": False},
}  # fmt: skip
LM = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2)  # fmt: skip
MODELS = {
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**LM)),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**LM)),
    "gpt2": lambda: T.GPT2LMHeadModel(
        T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ),  # fmt: skip
}


def build(name: str):
    torch.manual_seed(0)
    return MODELS[name]()


def batch(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -6:] = 0  # padding: masked and ignored by the loss
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    labels[0, :3] = -100  # a prompt the loss skips
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("chunk", [5, 1000])
@pytest.mark.parametrize("name", list(MODELS))
def test_fused_loss_and_gradients_equal_the_models_own(name, chunk):
    model, b = build(name), batch()
    own = model(**b).loss
    own.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    hidden = model.base_model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
    loss = fused_linear_cross_entropy(hidden, model.get_output_embeddings(), b["labels"], chunk)
    loss.backward()
    torch.testing.assert_close(loss, own, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_engine_trains_with_it_as_with_the_models_own_loss(name):
    batches = [batch(s) for s in range(4)]

    def run(overrides):
        eng, _, _ = engine.initialize(model=build(name), config=CFG, overrides=overrides)
        it = iter(batches)
        return [eng.train_batch(it) for _ in range(2)], eng.module.state_dict()

    ref_losses, ref_weights = run([])
    losses, weights = run(["model.fused_linear_cross_entropy=true", "model.fused_linear_cross_entropy_chunk_size=7"])
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k, v in ref_weights.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-4, atol=1e-5, msg=k)  # Adam magnifies rounding


def test_the_whole_logits_never_exist():
    """No tensor of tokens x vocab elements is created: the largest the loss allocates is one chunk's."""
    model, b, sizes = build("llama"), batch(), []
    hidden = model.base_model(input_ids=b["input_ids"]).last_hidden_state.detach().requires_grad_()

    class Sizes(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                sizes.append(out.numel())
            return out

    with Sizes():
        fused_linear_cross_entropy(hidden, model.lm_head, b["labels"], 8).backward()
    assert max(sizes) == max(8 * VOCAB, VOCAB * 32)  # one chunk's logits, or the head's gradient
    assert 2 * SEQ * VOCAB not in sizes


SHAPES = [(2048, 128, 64, torch.bfloat16), (2048, 128, 64, torch.float32), (4096, 64, 32, torch.bfloat16),
          (4096, 64, 1000, torch.bfloat16), (4096, 64, 1000, torch.float32), (8192, 64, 128, torch.bfloat16),
          (8192, 64, 128, torch.float32)]  # fmt: skip


@pytest.mark.parametrize(("vocab", "hidden", "chunk", "dtype"), SHAPES)
def test_its_bytes_are_the_peak_it_allocates(vocab, hidden, chunk, dtype):
    """fused_linear_cross_entropy_bytes against the bytes the loss's forward and backward allocate at their peak,
    for chunks smaller and larger than the tokens, in bf16 and fp32."""
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False).to(dtype)
    h = torch.randn(2, 128, hidden, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (2, 128))
    with PeakBytes() as p:
        loss = fused_linear_cross_entropy(h, head, labels, chunk) * 0.5
        forward, p.peak = p.peak, 0
        loss.backward()
    measured = max(forward, p.peak)
    stated = fused_linear_cross_entropy_bytes(256, hidden, vocab, chunk, h.element_size())
    assert stated == pytest.approx(measured, rel=0.03)
    assert chunk_bytes(1024, 152064) == 1024 * 152064 * 6  # bf16 logits beside their fp32 copy


@pytest.mark.parametrize(
    ("model", "kw", "why"),
    [(None, {}, "the built-in GPT computes its own loss"),
     ("llama", {"loss_fn": torch.nn.CrossEntropyLoss()}, "loss_fn takes the whole logits"),
     ("classifier", {}, "LlamaForSequenceClassification is not a causal LM")],
)  # fmt: skip
def test_refused_where_it_cannot_act(model, kw, why):
    if model == "classifier":
        model = T.LlamaForSequenceClassification(T.LlamaConfig(**LM, num_labels=3, pad_token_id=0))
    elif model is not None:
        model = build(model)
    cfg = CFG if model is not None else {**CFG, "model": {"num_layers": 1, "hidden_size": 32,
                                                          "num_attention_heads": 2, "seq_length": 16}}  # fmt: skip
    with pytest.raises(ValueError, match=r"^model\.fused_linear_cross_entropy=true.*" + why + ".*set it to false$"):
        engine.initialize(model=model, config=cfg, overrides=["model.fused_linear_cross_entropy=true"], **kw)
