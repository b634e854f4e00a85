"""A core-attention module for megatron-core's local spec that runs on CPU as well as CUDA.

megatron-core's own `DotProductAttention` cannot run without CUDA: it takes its score buffer from
`parallel_state.get_global_memory_buffer()` (allocated on `torch.cuda.current_device()`) and forks the CUDA
RNG tracker around its dropout. This module is a drop-in for the spec's `core_attention` slot with the same
constructor and call signature and the same layouts, computed with `F.scaled_dot_product_attention`:

    query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np * hn]

Masks follow megatron's convention: a boolean `attention_mask` is True where attention is NOT allowed; with no
mask and a causal mask type, causality comes from SDPA's `is_causal`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class SDPACoreAttention(nn.Module):
    """megatron-core core attention over torch SDPA (TP=1, no context parallel, no packed sequences)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        **_: Any,  # newer megatron-core versions pass extra construction keywords
    ) -> None:
        super().__init__()
        if getattr(config, "context_parallel_size", 1) != 1 or getattr(config, "tensor_model_parallel_size", 1) != 1:
            raise ValueError("SDPACoreAttention supports tensor and context parallel size 1 only")
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_query_groups or config.num_attention_heads
        self.head_dim = config.kv_channels
        # apply_query_key_layer_scaling divides the scale by the layer number and megatron's softmax multiplies
        # it back, so the effective scale is unchanged: 1/sqrt(hn) unless the config sets one
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        **_: Any,
    ) -> torch.Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn], mask [b|1, 1, sq, sk] bool -> [sq, b, np*hn]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention supports neither packed sequences nor an attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if self.num_groups != self.num_heads:  # grouped-query attention: repeat the kv heads to the query heads
            key = key.repeat_interleave(self.num_heads // self.num_groups, dim=2)
            value = value.repeat_interleave(self.num_heads // self.num_groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        causal = attention_mask is None and getattr(mask_type, "name", "") == "causal"
        ctx = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if attention_mask is None else ~attention_mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
        )
        sq, b = query.shape[0], query.shape[1]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.num_heads * self.head_dim)
