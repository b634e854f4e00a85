"""Fused linear cross-entropy (Liger's name; Megatron's `cross_entropy_loss_fusion` fuses only the loss): the
causal-LM loss from the final hidden states and the output head, over chunks of tokens, so the whole
[tokens, vocab] logits never exist at once, forward or backward.

As Liger does, each chunk's logits are computed, turned into the loss and straight into their gradient in the
forward (softmax minus one-hot over the valid tokens), which go into the hidden states' gradient and the head's
(an fp32 accumulator); backward only scales them by the incoming gradient. Three head matmuls, as unfused.
The numerics follow HF's own loss: the matmul in the compute dtype (autocast's or the weights'), the logits
upcast to fp32, labels shifted (position t predicts label t+1, -100 ignored), the mean over valid tokens.
"""

from __future__ import annotations

import torch
from torch import nn

IGNORE_INDEX = -100


def chunk_bytes(chunk_tokens: int, vocab_size: int, compute_itemsize: int = 2) -> int:
    """Bytes of one chunk's logits at their peak: in the compute dtype beside their fp32 copy (turned in place
    into their gradient, which is then cast back to the compute dtype); under fp32 they are one tensor."""
    return chunk_tokens * vocab_size * (4 + (compute_itemsize if compute_itemsize < 4 else 0))


def fused_linear_cross_entropy_bytes(tokens: int, hidden_size: int, vocab_size: int, chunk_tokens: int,
                                     compute_itemsize: int = 2) -> int:  # fmt: skip
    """Peak bytes the fused loss allocates beyond the hidden states (the head weight's gradient included: it is
    made while the loss's own buffers are alive).

    Forward: the head's fp32 gradient accumulator [vocab, hidden] and the hidden states' gradient [tokens, hidden]
    (compute dtype), held until backward, plus the largest chunk's working set: its logits (chunk_bytes), or its
    gradient in the compute dtype beside that gradient's contribution to the head's [vocab, hidden] (under fp32 the
    gradient is the logits). Backward: the accumulator and its product with the incoming gradient (fp32), that cast
    to the weight's dtype (the weight's gradient; under fp32 the product is), the hidden states' gradient and its
    product.
    The unfused loss holds tokens x vocab x (2 + 4 + 4 + 2) bytes instead (logits, fp32 upcast, their gradients)."""
    c, v, h = compute_itemsize, vocab_size, hidden_size
    chunk = min(chunk_tokens, tokens)
    held = 4 * v * h + tokens * h * c
    if c < 4:
        working = max(chunk_bytes(chunk, v, c), chunk * v * c + v * h * c)
    else:
        working = chunk * v * 4 + v * h * 4
    # the weight's gradient is made here, beside the accumulator (under fp32 it is the product itself)
    backward = 8 * v * h + (v * h * c if c < 4 else 0) + 2 * tokens * h * c
    return max(held + working, backward)


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    kind = h.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return weight.dtype


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, labels, chunk_tokens):  # noqa: ANN001, ANN205 - autograd's signature
        dtype = _compute_dtype(h, weight)
        grads = any(ctx.needs_input_grad[:3])  # forward runs without grad mode; this says what backward needs
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            valid = labels != IGNORE_INDEX
            count = valid.sum()
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h = torch.empty(h.shape, dtype=dtype, device=h.device) if grads else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if grads else None
            grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) if grads and b is not None \
                else None  # fmt: skip
            for start in range(0, h.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                x, y, ok = h[rows].to(dtype), labels[rows], valid[rows]
                logits = nn.functional.linear(x, w, b).float()
                lse = torch.logsumexp(logits, dim=-1)
                target = logits.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
                total += ((lse - target) * ok).sum()
                if not grads:
                    continue
                probs = logits.sub_(lse.unsqueeze(1)).exp_()  # in place: the fp32 logits become the softmax
                probs[torch.arange(len(y), device=y.device), y.clamp(min=0)] -= 1.0
                probs.mul_((ok / count).unsqueeze(1))
                g = probs.to(dtype)
                del probs, logits
                grad_h[rows] = g @ w
                grad_w += g.t() @ x
                if grad_b is not None:
                    grad_b += g.float().sum(0)
                del g  # else it lives on beside the next chunk's logits
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.dtypes = (h.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total / count

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        (grad_h, grad_w, grad_b), (dh, dw, db) = ctx.grads, ctx.dtypes
        ctx.grads = None
        if grad_h is None:
            return None, None, None, None, None
        return ((grad_h * grad_out).to(dh), (grad_w * grad_out).to(dw),
                None if grad_b is None else (grad_b * grad_out).to(db), None, None)  # fmt: skip


def fused_linear_cross_entropy(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, chunk_tokens: int
                               ) -> torch.Tensor:  # fmt: skip
    """The causal-LM loss of `hidden` [batch, seq, hidden] through `head` against `labels` [batch, seq] (the
    input ids, -100 ignored), shifted as HF's loss shifts them; never more than `chunk_tokens` rows of logits."""
    shifted = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _FusedLinearCrossEntropy.apply(flat, head.weight, head.bias, shifted.reshape(-1).to(hidden.device),
                                          chunk_tokens)  # fmt: skip


_KEY = "model.fused_linear_cross_entropy=true"


def output_head(model: nn.Module, causal_lm: bool) -> nn.Linear:
    """The causal LM's output head; ValueError naming the key where the fused loss cannot act on `model`."""
    name = type(model).__name__
    get = getattr(model, "get_output_embeddings", None)
    head = get() if causal_lm and callable(get) else None
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{_KEY} computes an HF causal LM's loss from its output head, and {name} is not a causal "
                         "LM with get_output_embeddings() returning an nn.Linear; set it to false")  # fmt: skip
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_router_logits"):
        if getattr(config, attr, None) not in (None, False, 1, 1.0):
            raise ValueError(f"{_KEY}: {name} applies config.{attr}={getattr(config, attr)} between its output head "
                             "and its loss, which the fused loss does not; set it to false")  # fmt: skip
    return head


def model_loss(model: nn.Module, head: nn.Linear, labels: torch.Tensor, chunk_tokens: int, call) -> torch.Tensor:  # noqa: ANN001
    """Runs `call()` (the model's forward, without labels) with `head` returning the fused loss of the hidden
    states it is given in place of the logits, and returns that loss. The output's `.logits` must be the very
    tensor the head returned: a model that transforms its logits after the head is refused."""
    returned = []

    def fused(hidden: torch.Tensor) -> torch.Tensor:
        returned.append(fused_linear_cross_entropy(hidden, head, labels, chunk_tokens))
        return returned[-1]

    head.forward = fused  # an instance attribute for this call only: state_dict and the module tree unchanged
    try:
        out = call()
    finally:
        del head.forward
    logits = getattr(out, "logits", None)
    if len(returned) != 1 or logits is not returned[0]:
        raise ValueError(f"{_KEY}: {type(model).__name__} does not return its output head's result as .logits "
                         "unchanged, so the fused loss cannot stand in for it; set it to false")  # fmt: skip
    return logits
