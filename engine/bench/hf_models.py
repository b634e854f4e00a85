"""Named HuggingFace causal-LM shapes, built from their configs with random weights (nothing is downloaded), and
their model FLOPs per token. One table for `bin/bench scale --hf-config` and examples/hf_causal_lm.py --preset.

A shape is the keyword arguments of its transformers config class (`model_type` picks the class), as the
model's published config.json gives them; a local config.json (or a directory holding one) is read the same way.
transformers is an extra (`pip install .[hf]`): imported only when a model is built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

SHAPES: dict[str, dict[str, Any]] = {
    # a few hundred thousand parameters: tests and CPU dry runs
    "tiny": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
    "tiny-moe": dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128,
                     moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256),
    # TinyLlama-1.1B
    "llama-1.1b": dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                       num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                       max_position_embeddings=2048),
    # Llama-3-8B (8.03 B parameters)
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5),
    # Qwen2.5-7B (7.62 B parameters; vocab 152064, untied head, q/k/v biases)
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False),
    # Qwen3-30B-A3B (30.5 B parameters, 3.3 B active: 128 experts of which 8 per token, in every layer)
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=40960,
                          rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
}  # fmt: skip


def known() -> str:
    return ", ".join(SHAPES)


def shape_of(spec: str) -> dict[str, Any]:
    """A named shape, or a local config.json / a directory holding one, as config keyword arguments.
    ValueError (one line, listing the known names) for anything else."""
    if spec in SHAPES:
        return dict(SHAPES[spec])
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--hf-config {spec}: neither a config.json nor a known shape; known: {known()}")
    try:
        shape = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--hf-config {spec}: not readable as JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(shape, dict) or not isinstance(shape.get("model_type"), str):
        raise ValueError(f"--hf-config {spec}: a HF config.json names its model_type; this one does not")
    return shape


def hf_config(shape: dict[str, Any], layers: int | None = None) -> Any:
    """The transformers config of `shape`, at `layers` layers when given (per-layer lists cut to that depth)."""
    import transformers

    kw = dict(shape)
    if layers is not None:
        kw["num_hidden_layers"] = layers
        if isinstance(kw.get("layer_types"), list):
            kw["layer_types"] = kw["layer_types"][:layers]
    model_type = kw.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **kw)
    except ValueError as e:
        raise ValueError(f"model_type {model_type!r}: {str(e).splitlines()[0]}") from None


def build(config: Any, device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    """The causal LM of `config` with random weights, built on `device` in `dtype` (no host or fp32 copy of a
    large model); the same weights for the same seed."""
    import transformers

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            return transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)


def meta_model(config: Any) -> nn.Module:
    """The model of `config` on the meta device: its parameters' names and shapes, no storage."""
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def expert_share(config: Any) -> float:
    """The share of an expert weight one token multiplies with: experts per token / experts (1 for dense)."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    per_token = getattr(config, "num_experts_per_tok", None)
    return per_token / experts if experts and per_token else 1.0


def active_matmul_params(model: nn.Module, config: Any) -> int:
    """N: the weights a token multiplies with (attention, MLP or the experts it is routed to, router, output
    head); embedding lookups, biases and norms are not counted. An expert weight counts at `expert_share`."""
    emb = model.get_input_embeddings().weight
    share = expert_share(config)
    n = 0.0
    for name, p in model.named_parameters():
        if p is emb or p.dim() < 2:
            continue
        n += p.numel() * (share if "experts" in name.split(".") else 1.0)
    out = model.get_output_embeddings()
    if out is not None and out.weight is emb:  # a tied head multiplies with the embedding's weight
        n += emb.numel()
    return int(round(n))


def attention_width(config: Any) -> int:
    """heads x head_dim: the width of the attention scores' matmuls (the hidden size for most models)."""
    heads = config.num_attention_heads
    return heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)


def flops_per_token(model: nn.Module, config: Any, seq: int) -> dict[str, float]:
    """Model FLOPs per trained token: 6N + 12*L*a*s (a = heads x head_dim), as the built-in GPT's are counted."""
    n = active_matmul_params(model, config)
    dense = 6 * n
    attention = 12 * config.num_hidden_layers * attention_width(config) * seq
    causal = 6 * config.num_hidden_layers * attention_width(config) * (seq + 1)
    return {"n": n, "dense": dense, "attention": attention, "total": dense + attention, "causal_total": dense + causal}


FORMULA = """\
FLOPs per token = 6*N + 12*L*a*s  (forward 2 per multiply-add, backward twice the forward)
  N = the matmul weights a token multiplies with: attention, MLP (a MoE: the router and the experts it is routed
      to, each expert weight counted at experts-per-token / experts), output head; embedding lookups, biases and
      norms not counted
  12*L*a*s: per layer, QK^T and softmax(QK^T)V over the full s x s scores (a = heads x head_dim), x3 with the
      backward: Megatron's and PaLM's MFU convention (a causal kernel computes about half: 6*L*a*(s+1))"""
