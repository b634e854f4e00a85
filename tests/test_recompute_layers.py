"""Full recompute of a counted block of layers (model.recompute_num_layers), after the offloaded ones: the
built-in GPT, a user's model and the memory plan agree on which layers recompute, none is also offloaded, and
results are unchanged."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.build import build_model
from engine.config import load_config
from engine.models.gpt import GPT, gpt_loss, recomputed_layers
from engine.planning import planner
from engine.planning.memory import evaluate
from engine.user_model import RecomputedModule

TINY = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 64}


def test_the_block_follows_the_offloaded_layers():
    assert recomputed_layers(6, 2, 3) == range(2, 5)
    assert recomputed_layers(6, 0, None) == range(6)  # every layer (the offloading rule refuses it with k > 0)
    assert recomputed_layers(6, 4, 5) == range(4, 6)  # clipped: never past the last layer
    assert recomputed_layers(6, 1, 0) == range(1, 1)


def _saved_outside_checkpoints(model, tokens) -> tuple[int, dict[str, torch.Tensor]]:
    n = [0]

    def pack(t):
        n[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = gpt_loss(model(tokens), tokens)
    loss.backward()
    return n[0], {k: p.grad.clone() for k, p in model.named_parameters()}


def test_builtin_gpt_recomputes_only_its_block_with_the_same_gradients():
    torch.manual_seed(0)
    plain = GPT(**TINY)
    state = plain.state_dict()
    tokens = torch.randint(0, 64, (2, 16))
    counts, grads = {}, {}
    for name, kw in {"none": {}, "one": {"recompute_granularity": "full", "recompute_layers": range(2, 3)},
                     "all": {"recompute_granularity": "full"}}.items():  # fmt: skip
        model = GPT(**TINY, **kw)
        model.load_state_dict(state)
        counts[name], grads[name] = _saved_outside_checkpoints(model, tokens)
    assert all(torch.equal(grads["one"][k], g) and torch.equal(grads["all"][k], g) for k, g in grads["none"].items())
    per_layer = (counts["none"] - counts["all"]) / 4  # what one layer saves outside a checkpoint
    assert per_layer > 0 and counts["none"] - counts["one"] == per_layer


def test_the_builder_reads_the_count_and_the_offloaded_layers():
    cfg = load_config({"model": {**TINY, "cpu_offloading": True, "cpu_offloading_num_layers": 1,
                                 "recompute_granularity": "full", "recompute_num_layers": 2}})  # fmt: skip
    model = build_model(cfg.model, torch.device("cpu"), seed=0)
    assert model.recompute_layers == range(1, 3)
    plain = build_model(load_config({"model": TINY}).model, torch.device("cpu"), seed=0)
    assert plain.recompute_layers == range(0)


def test_the_plan_keeps_only_the_inputs_of_the_recomputed_layers():
    cfg = load_config({"model": {**TINY, "cpu_offloading": True, "cpu_offloading_num_layers": 1,
                                 "recompute_granularity": "full", "recompute_num_layers": 2},
                       "train": {"device": "cpu", "precision": "fp32", "micro_batch_size": 2,
                                 "global_batch_size": 2}})  # fmt: skip
    p = planner(cfg, device="cpu")
    acts = p.census.activations
    layer, kept = acts.layer_bytes(0), sum(x.nbytes for x in acts.checkpointed)
    assert kept == 2 * 16 * 32 * 4  # the layer's fp32 input, [2 x 16, 32]
    plans = {r: evaluate(p.census, p.settings, 0.0, 1, cuda=False, gpu_budget=None, host_budget=None, r=r)
             for r in (0, 1, 2, 3, 9)}  # fmt: skip
    assert [plans[r].recomputed_layers for r in (0, 1, 2, 3, 9)] == [0, 1, 2, 3, 3]  # at most the 3 not offloaded
    fwd = {r: plans[r].gpu.phases["forward"] for r in plans}
    assert fwd[1] - fwd[2] == fwd[2] - fwd[3] == layer - kept
    assert fwd[0] - fwd[1] == layer - kept  # the first recomputed layer also frees its activations
    assert p.evaluate(0.0, 1).recomputed_layers == 2  # the config's count when no candidate is given


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))  # fmt: skip


USER = {"train": {"device": "cpu", "precision": "fp32", "global_batch_size": 2, "micro_batch_size": 2},
        "logging": {"metrics_file": None, "progress_bar": False}}  # fmt: skip


def test_a_user_model_recomputes_the_block_after_its_offloaded_layers():
    model = _llama()
    ids = torch.randint(0, 64, (2, 16))
    eng, _, _ = engine.initialize(model=model, config=USER, overrides=[
        "model.cpu_offloading=true", "model.cpu_offloading_num_layers=1", "model.recompute_granularity=full",
        "model.recompute_num_layers=2"])  # fmt: skip
    eng.train_batch(iter([{"input_ids": ids, "labels": ids}]))  # planned and built at the first micro-batch
    flags = [isinstance(layer, RecomputedModule) for layer in eng.module.model.layers]
    assert flags == [False, True, True, False]


def test_a_user_model_s_block_past_its_layers_is_refused_in_megatron_s_words():
    with pytest.raises(
        ValueError,
        match=r"model\.recompute_num_layers=3: CPU offloading does not work when "
        r"activation recomputation is enabled on the same layer: 2 of 4 layers",
    ):
        engine.initialize(model=_llama(), config=USER, overrides=[
            "model.cpu_offloading=true", "model.cpu_offloading_num_layers=2", "model.recompute_granularity=full",
            "model.recompute_num_layers=3"])  # fmt: skip
