"""The model, data and FLOP count every peer of `bin/bench peers` trains: built the same way in each process."""

from __future__ import annotations

import torch

from engine.bench.scale import Shape
from engine.data import TokenBatches, stdlib_bytes
from engine.models.gpt import GPT, gpt_loss

MODELS = ("gpt", "llama")
VOCAB = 256  # the stdlib bytes


def llama_ffn(hidden: int) -> int:
    """Llama's SwiGLU width: 8/3 of the hidden size, rounded up to a multiple of 64."""
    return -(-8 * hidden // 3 // 64) * 64


def build(spec: dict, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The spec's model, its initial weights drawn from spec["seed"] on `device` in fp32, then cast to `dtype`.

    Every peer starts from the same values: the draw is rounded to bf16 first, because the peers that train bf16
    weights (ours, megatron-core, DeepSpeed) can only start from those, and an fp32 start off the bf16 grid lets
    tiny updates cross rounding boundaries that a bf16 start does not, which reads as a loss difference between
    mechanisms that is really one between initial weights (tools/peers_rounded_init.py measures it;
    spec["bf16_start"] False keeps the fp32 draw).
    """
    torch.manual_seed(spec["seed"])
    with torch.device(device):
        if spec["model"] == "gpt":
            model = GPT(num_layers=spec["layers"], hidden_size=spec["hidden"], num_attention_heads=spec["heads"],
                        seq_length=spec["seq"], vocab_size=VOCAB)  # fmt: skip
        else:
            import transformers as T

            ffn = llama_ffn(spec["hidden"])
            cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=spec["hidden"], intermediate_size=ffn,
                                num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                                num_key_value_heads=spec["heads"], max_position_embeddings=spec["seq"],
                                tie_word_embeddings=False)  # fmt: skip
            model = T.LlamaForCausalLM(cfg)
    return (model.to(torch.bfloat16) if spec.get("bf16_start", True) else model).to(dtype)


def logits(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    out = model(inputs)
    return out if isinstance(out, torch.Tensor) else out.logits


def loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The one loss of every peer: mean next-token cross-entropy in fp32 (engine.models.gpt.gpt_loss)."""
    return gpt_loss(logits(model, inputs), labels)


def batches(spec: dict, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """warmup + iters micro-batches of stdlib bytes, the same windows in every process (the engine's TokenBatches)."""
    data = TokenBatches(stdlib_bytes(spec["data_bytes"]), spec["seq"], spec["micro_batch"], spec["seed"])
    return [tuple(t.to(device) for t in next(data)) for _ in range(spec["warmup"] + spec["iters"])]


def flops_per_token(spec: dict) -> float:
    """Model FLOPs per token, counted as `bin/bench scale` counts them (6*N + 12*L*h*s, full attention scores)."""
    shape = Shape(spec["layers"], spec["hidden"], spec["heads"], spec["seq"], VOCAB)
    if spec["model"] == "gpt":
        return shape.flops_per_token()["total"]
    h, layers = spec["hidden"], spec["layers"]
    matmul = layers * (4 * h * h + 3 * h * llama_ffn(h)) + h * VOCAB  # q, k, v, o; gate, up, down; lm_head
    return 6 * matmul + 12 * layers * h * spec["seq"]
