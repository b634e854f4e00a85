"""The memory plan's census of `model.implementation="megatron"`: megatron-core's own GPTModel, not the built-in's.

Parameters: the GPTModel `engine.megatron.build_gpt` would build, constructed on the meta device (every name and
shape, no storage), so the optimizer's split, the layer units and the weight bytes are megatron's. Its layers are
identical, so it is built at two layers and its layer run given the depth (engine.planning.runs), as the built-in
GPT's census does: planning costs the same at 40 layers or 100,000 (tests/test_megatron_plan.py holds the census at
depth N equal to the full-depth build's parameters). The Transformer
Engine spec is counted from the local spec of the same shape: TE fuses each norm into the linear after it
(`linear_qkv.layer_norm_weight`), which renames parameters but keeps every element.

Activations: what one megatron-core layer saves is, storage by storage, what the built-in GPT's layer saves
(pre-norm LayerNorm, fused QKV, flash/SDPA attention, GELU MLP; tests/test_megatron_plan.py holds the formula
equal to a measured megatron layer), so the built-in formula is used at megatron's shape. One difference is
counted on top: megatron-core's own DotProductAttention (the local spec on CUDA) materialises the softmax
probabilities [b, heads, s, s] in fp32 and in the compute dtype instead of the flash kernel's logsumexp.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.config import Config
from engine.models.gpt import ffn_size
from engine.optim.partition import forward_order
from engine.planning.activations import FP32, Activations, Saved, gpt_activations
from engine.planning.census import Census, _groups, _training_bytes
from engine.planning.runs import runs_of


def megatron_census(cfg: Config, *, cuda: bool) -> Census:
    """The megatron-core GPTModel of `model.*`, built on the meta device at two layers and counted per distinct
    layer shape (module doc)."""
    from engine.megatron.gpt import meta_gpt

    m, t = cfg.model, cfg.train
    # the run's device for megatron's parallel state, which this may be the first to set up (build_gpt keeps it)
    device = "cuda" if cuda and torch.cuda.is_available() else "cpu"
    # identical layers are counted once, as the built-in GPT's (census.builtin_census): built at two layers (a
    # second shows the run repeats), the layer run given the depth; recompute changes no parameter
    built = min(m.num_layers, 2)
    small = replace(m, num_layers=built, recompute_granularity=None, recompute_num_layers=None)
    model = meta_gpt(small, seed=t.seed, device=device)
    half = t.params_dtype == "half"
    index = {id(p): i for i, layer in enumerate(model.layers) for p in layer.parameters()}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    by_name = dict(named)
    order = forward_order([n for n, _ in named])
    layer_of = {n: index.get(id(by_name[n])) for n in order}
    runs = runs_of([(n, by_name[n].numel()) for n in order], _groups(order, layer_of))
    runs = tuple(replace(r, count=m.num_layers) if r.count == built > 1 else r for r in runs)
    in_layer = {id(x) for x in [*model.layers[0].parameters(), *model.layers[0].buffers()]}
    inside = {id(x) for layer in model.layers for x in [*layer.parameters(), *layer.buffers()]}
    tensors = [*model.parameters(), *model.buffers()]
    per_layer = sum(_training_bytes(x, half) for x in tensors if id(x) in in_layer)
    outside = sum(_training_bytes(x, half) for x in tensors if id(x) not in inside)
    ffn = ffn_size(m.hidden_size, m.ffn_hidden_size)
    acts = gpt_activations(num_layers=m.num_layers, hidden=m.hidden_size, ffn=ffn, heads=m.num_attention_heads,
                           seq=m.seq_length, vocab=m.vocab_size, micro_batch=t.micro_batch_size,
                           precision=t.precision, params_dtype=t.params_dtype, recompute=m.recompute_granularity,
                           cuda=cuda)  # fmt: skip
    notes = []
    if cuda and not m.use_te and m.recompute_granularity is None:
        acts = _with_dot_product_probs(acts, cfg)
        notes.append("megatron-core's DotProductAttention keeps the [batch, heads, seq, seq] softmax probabilities "
                     "(fp32 and compute dtype) per layer; model.use_te=true runs flash attention instead")  # fmt: skip
    if m.use_te:
        notes.append("Transformer Engine spec counted from megatron-core's local spec of the same shape "
                     "(TE fuses the norms into the linear layers: same elements)")  # fmt: skip
    if t.precision != "fp32" and not half:
        notes.append("megatron-core layers under autocast with fp32 weights are planned as the built-in GPT's "
                     "(autocast's weight copies counted); train.params_dtype=\"half\" is planned exactly")  # fmt: skip
    return Census(
        runs=runs,
        weight_bytes=outside + m.num_layers * per_layer,
        n_layers=m.num_layers,
        activations=replace(acts, source="formula (megatron-core GPTModel)"),
        builtin=False,
        notes=tuple(notes),
    )


def _with_dot_product_probs(acts: Activations, cfg: Config) -> Activations:
    m, t = cfg.model, cfg.train
    b, s, heads = t.micro_batch_size, m.seq_length, m.num_attention_heads
    a = FP32 if t.precision == "fp32" else 2
    scores = b * heads * s * s
    probs = [Saved("core_attention.probs (fp32 softmax)", scores * FP32, (("self_attention", "SelfAttention"),))]
    if a != FP32:
        probs.append(Saved("core_attention.probs", scores * a, (("self_attention", "SelfAttention"),)))
    layer = [x for x in acts.layers[0] if x.what != "attn.logsumexp"] + probs
    return replace(acts, layers=[layer] * len(acts.layers))


__all__ = ["megatron_census"]
