"""The built-in GPT: a pre-norm decoder with SDPA attention, shaped by `model.*` of the config.

Its transformer blocks live in `GPT.layers` (a ModuleList), the place layer discovery looks first. Built under
`torch.device("meta")` it allocates nothing; `engine.models.init.materialize` then gives it storage on the target
device and calls `init_from_seed` there (the engine's builder does both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from engine.messages import heads_divide_hidden
from engine.models.init import draw_seed, init_transformer_


def ffn_size(hidden_size: int, ffn_hidden_size: int | None = None) -> int:
    """The MLP's width: as given, else 4 x hidden (GPT-2's, and Megatron's default)."""
    return ffn_hidden_size or 4 * hidden_size


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, recompute_core: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.recompute_core = recompute_core

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, hidden] -> [batch, seq, hidden]."""
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, h // self.num_heads).permute(2, 0, 3, 1, 4)
        if self.recompute_core and torch.is_grad_enabled():
            # selective recompute (Megatron's "selective"): keep q, k, v, recompute the attention core
            y = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            y = self._core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_hidden_size)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class TransformerLayer(nn.Module):
    """One pre-norm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int, recompute_core: bool = False) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden_size)
        self.attn = CausalSelfAttention(hidden_size, num_heads, recompute_core)
        self.mlp_norm = nn.LayerNorm(hidden_size)
        self.mlp = MLP(hidden_size, ffn_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token + learned position embeddings, `num_layers` blocks, final norm, untied output head."""

    def __init__(
        self,
        *,
        num_layers: int,
        hidden_size: int,
        num_attention_heads: int,
        seq_length: int,
        vocab_size: int,
        ffn_hidden_size: int | None = None,
        init_method_std: float = 0.02,
        recompute_granularity: str | None = None,
        layers: nn.ModuleList | None = None,
        seed: int | None = None,
        recompute_layers: range | None = None,
    ) -> None:
        """layers: blocks built elsewhere (Transformer Engine's) in place of the built-in ones; they initialise
        their own weights, so `init_from_seed` leaves them alone. seed: of the initial weights (None: drawn from
        torch's default generator, so `torch.manual_seed` before the constructor reproduces them). Built on the
        meta device, the model is left uninitialised for `materialize`."""
        super().__init__()
        if (why := heads_divide_hidden(hidden_size, num_attention_heads)) is not None:
            raise ValueError(f"model.hidden_size={hidden_size}: {why}")
        ffn = ffn_size(hidden_size, ffn_hidden_size)
        self.seq_length = seq_length
        # full recompute: these layers (all by default) keep only their input and run their forward again in backward
        full = recompute_granularity == "full"
        self.recompute_layers = (
            (range(num_layers) if recompute_layers is None else recompute_layers) if full else range(0)
        )
        # given weights, nn.Embedding skips its own normal_ init, which on the meta device imports torch._dynamo
        # (seconds, once); init_from_seed draws them anyway
        self.embedding = nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))
        self.position_embedding = nn.Embedding(seq_length, hidden_size, _weight=torch.empty(seq_length, hidden_size))
        own_layers = layers is None
        if own_layers:
            layers = nn.ModuleList(
                TransformerLayer(hidden_size, num_attention_heads, ffn, recompute_granularity == "selective")
                for _ in range(num_layers)
            )
        self.layers = layers
        self.final_norm = nn.LayerNorm(hidden_size)
        self.output = nn.Linear(hidden_size, vocab_size, bias=False)
        self.init_method_std, self.num_layers, self.own_layers = init_method_std, num_layers, own_layers
        # Transformer Engine layers' is_first_microbatch, set by the engine's FP8 forward only (precision.py):
        # True casts the weights to FP8 into TE's cache, False reuses that cache, None (unset) neither
        self.first_microbatch: bool | None = None
        if not self.embedding.weight.is_meta:
            self.init_from_seed(draw_seed() if seed is None else seed)

    def init_from_seed(self, seed: int) -> None:
        """GPT-2's init (engine.models.init): N(0, std), the residual-output projections (attention proj, fc2)
        scaled by 1/sqrt(2 * num_layers), biases zero, LayerNorm weights one; blocks built elsewhere untouched."""
        named = [(n, p) for n, p in self.named_parameters() if self.own_layers or not n.startswith("layers.")]
        init_transformer_(named, seed, std=self.init_method_std, num_layers=self.num_layers)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [batch, seq] int64 -> logits [batch, seq, vocab]."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding(tokens) + self.position_embedding(positions)
        te = {} if self.first_microbatch is None else {"is_first_microbatch": self.first_microbatch}
        for i, layer in enumerate(self.layers):
            if i in self.recompute_layers and torch.is_grad_enabled():
                x = checkpoint(layer, x, use_reentrant=False, **te)
            else:
                x = layer(x, **te)
        return self.output(self.final_norm(x))


def recomputed_layers(layers: int, offloaded: int, count: int | None) -> range:
    """The layers full recompute runs again in backward: `count` of them (None: every layer) right after the
    `offloaded` first ones (megatron-core's "block" method, moved past the offloaded layers so none is both)."""
    if count is None:
        return range(layers)
    return range(offloaded, min(layers, offloaded + count))


def gpt_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32. logits: [b, s, v], labels: [b, s]."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
