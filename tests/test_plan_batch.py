"""The plan measured at the user's batch: activations and logits of tiny HF models against a forward that keeps
what it saves, and no "fits" claimed without a batch."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import engine
from engine.config import load_config
from engine.offload.discovery import find_layer_stacks
from engine.planning import format_plan, planner, resolve
from engine.planning.auto import NothingFits

transformers = pytest.importorskip("transformers")
GIB = 1 << 30


def llama(attention: str = "sdpa"):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, attn_implementation=attention))  # fmt: skip


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=1000, n_embd=64, n_layer=3, n_head=4,
                                                                n_positions=512))  # fmt: skip


def t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=1000, d_model=64, d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0))  # fmt: skip


def batch_for(name: str, rows: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, 1000, (rows, seq), generator=g)
    if name == "t5":  # the decoder's length differs from the encoder's
        return {"input_ids": ids, "labels": torch.randint(0, 1000, (rows, seq // 2), generator=g)}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def kept_by_forward(model, batch) -> tuple[int, int]:
    """(bytes saved inside the layers, bytes saved outside them) by one forward + loss that keeps every saved
    tensor, as backward will find them."""
    params = {StorageWeakRef(p.untyped_storage()) for p in [*model.parameters(), *model.buffers()]}
    where = ["head"]
    for _, stack in find_layer_stacks(model):
        for layer in stack:
            layer.register_forward_pre_hook(lambda m, a: where.__setitem__(0, "layer"))
            layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, "head"))
    seen: dict = {}

    def pack(t):
        key = StorageWeakRef(t.untyped_storage())
        if key not in params and key not in seen:
            seen[key] = (where[0], t.untyped_storage().nbytes(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    inside = sum(b for w, b, _ in seen.values() if w == "layer")
    del loss
    return inside, sum(b for w, b, _ in seen.values() if w == "head")


def config(rows: int, extra=()):
    return load_config({}, [f"train.micro_batch_size={rows}", f"train.global_batch_size={2 * rows}",
                            "train.precision=fp32", *extra], model_in_hand=True)  # fmt: skip


@pytest.mark.parametrize("name", ["llama", "llama-eager", "gpt2", "t5"])
@pytest.mark.parametrize("seq", [32, 160])
def test_activations_and_logits_at_the_batch_equal_what_the_forward_saves(name, seq):
    """Eager attention's [heads, seq, seq] probabilities (quadratic in tokens) are measured as they are, as is SDPA."""
    torch.manual_seed(0)
    model = {"llama": llama, "llama-eager": lambda: llama("eager"), "gpt2": gpt2, "t5": t5}[name]()
    batch = batch_for(name, 2, seq)
    inside, outside = kept_by_forward(model, batch)
    p = planner(config(2), model, device="cpu", host_budget_bytes=8 * GIB, example_batch=batch)
    acts = p.census.activations
    planned_inside = sum(acts.layer_bytes(i) for i in range(len(acts.layers)))
    planned_outside = sum(s.nbytes for s in acts.head)
    assert abs(planned_inside - inside) <= 0.1 * inside
    assert abs(planned_outside - outside) <= 0.1 * outside
    # the logits' fp32 log-softmax is the largest storage outside the layers; its backward doubles it
    vocab_tokens = batch["labels"].numel() * 1000 * 4
    assert acts.logits_transient >= 2 * vocab_tokens
    plan = resolve(p)
    assert plan.batch_seen and plan.fits
    assert plan.gpu.phases["forward"] >= plan.gpu.parts["weights"] + planned_inside + planned_outside


def test_the_layers_are_measured_each_not_taken_alike():
    torch.manual_seed(0)
    model = t5()  # encoder and decoder layers save different bytes (cross-attention, another length)
    p = planner(config(2), model, device="cpu", host_budget_bytes=8 * GIB, example_batch=batch_for("t5", 2, 64))
    per_layer = [p.census.activations.layer_bytes(i) for i in range(4)]
    assert per_layer[0] != per_layer[2] and min(per_layer) > 0


def test_without_a_batch_no_fit_is_claimed_and_auto_is_refused():
    torch.manual_seed(0)
    model = llama()
    plan = engine.plan(config(2), model, device="cpu", host_budget_bytes=8 * GIB)
    assert plan.memory_fits and not plan.batch_seen
    assert not plan.fits and plan.to_json()["fits"] is None
    assert "fits: not known" in format_plan(plan)
    cfg = config(2, ["optimizer.optimizer_cpu_offload=true", "optimizer.use_distributed_optimizer=true",
                     "optimizer.optimizer_offload_fraction=auto"])  # fmt: skip
    with pytest.raises(NothingFits, match=r'optimizer_offload_fraction="auto" needs the activations .* example_batch='):
        engine.plan(cfg, model, device="cpu", gpu_budget_bytes=8 * GIB, host_budget_bytes=8 * GIB)
    chosen = engine.plan(cfg, model, device="cpu", gpu_budget_bytes=8 * GIB, host_budget_bytes=8 * GIB,
                         example_batch=batch_for("llama", 2, 32))  # fmt: skip
    assert chosen.fits and chosen.auto["optimizer.optimizer_offload_fraction"]


def test_a_batch_of_other_rows_than_the_micro_batch_is_refused():
    with pytest.raises(ValueError, match=r"example_batch has 3 rows and train.micro_batch_size=2"):
        engine.plan(config(2), llama(), device="cpu", host_budget_bytes=8 * GIB, example_batch=batch_for("llama", 3, 8))


def test_initialize_measures_the_example_batch():
    torch.manual_seed(0)
    batch = batch_for("llama", 2, 32)
    eng, _, _ = engine.initialize(model=llama(), config={"train": {"micro_batch_size": 2, "global_batch_size": 2,
                                  "device": "cpu", "precision": "fp32"}}, example_batch=batch)  # fmt: skip
    from engine.planning import preflight

    _, plan = preflight.last()
    assert plan.batch_seen and plan.activations_source.startswith("measured at the example batch")
    assert plan.activations_source.endswith("on cpu, sdpa attention")  # the kernel measured, named
    assert eng.train_batch(iter([batch])) > 0


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("fused", [False, True])
def test_the_loss_is_counted_at_the_peak_it_allocates(fused, precision):
    """A large vocabulary against a small hidden size, so the loss dominates: the plan's activations, what is saved
    outside the layers and the logits/loss transient equal the peak the forward and backward allocate beyond the
    weights and their gradients (the model's own loss: half logits, their fp32 upcast, log-softmax and its gradients;
    model.fused_linear_cross_entropy: the chunked loss's own figure)."""
    from peak_bytes import PeakBytes

    from engine.batch import BatchLoss

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=8192, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))  # fmt: skip
    extra = ["train.params_dtype=half"] if precision == "bf16" else []
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    if fused:
        extra += ["model.fused_linear_cross_entropy=true", "model.fused_linear_cross_entropy_chunk_size=64"]
    ids = torch.randint(0, 8192, (2, 128))
    batch = {"input_ids": ids, "labels": ids}
    run = BatchLoss(None, True)
    run.fused = (model.lm_head, 64) if fused else None
    with PeakBytes(grads_of=tuple(model.parameters())) as p:
        loss = run(model, batch, torch.device("cpu")) * 0.5
        forward, p.peak = p.peak, 0
        loss.backward()
    cfg = config(2, [f"train.precision={precision}", *extra])
    acts = planner(cfg, model, device="cpu", host_budget_bytes=8 * GIB, example_batch=batch).census.activations
    planned = sum(map(acts.layer_bytes, range(2))) + sum(s.nbytes for s in acts.head) + acts.logits_transient
    assert planned == pytest.approx(max(forward, p.peak), rel=0.03)
    full_logits = 256 * 8192 * 4
    assert (acts.logits_transient < full_logits) == fused


@pytest.mark.parametrize("recompute", [False, True])
def test_a_user_model_that_does_not_fit_is_told_to_recompute(recompute):
    """A user model has no depth the plan can shrink; recomputing layers is the fix left inside the run."""
    torch.manual_seed(0)
    extra = ["optimizer.optimizer_cpu_offload=true", "optimizer.use_distributed_optimizer=true",
             "optimizer.optimizer_offload_fraction=auto", "model.cpu_offloading=true",
             "model.cpu_offloading_num_layers=auto"]  # fmt: skip
    if recompute:
        extra += ["model.recompute_granularity=full", "model.recompute_num_layers=auto"]
    with pytest.raises(NothingFits) as e:
        engine.plan(config(2, extra), llama(), device="cpu", gpu_budget_bytes=1 << 20, host_budget_bytes=1 << 20,
                    example_batch=batch_for("llama", 2, 32))  # fmt: skip
    assert "use a smaller model or lower train.micro_batch_size (now 2)" in str(e.value)
    assert ('model.recompute_granularity="full" and model.recompute_num_layers="auto"' in str(e.value)) != recompute
