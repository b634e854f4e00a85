"""Activation offloading on a GPU: peak activation memory drops with the offloaded share, gradients unchanged."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.models.gpt import GPT, gpt_loss
from engine.offload import apply_activation_offloading, apply_fine_grained_offloading

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA"),
]

L, H, HEADS, S, V, B = 24, 512, 8, 1024, 1024, 4


def build() -> GPT:
    torch.manual_seed(0)
    model = GPT(num_layers=L, hidden_size=H, num_attention_heads=HEADS, seq_length=S, vocab_size=V)
    return model.to("cuda", torch.bfloat16)


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (
        torch.randint(0, V, (B, S), device="cuda", generator=g),
        torch.randint(0, V, (B, S), device="cuda", generator=g),
    )


def settle() -> int:
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # lets the allocator release blocks whose side-stream copies have finished
    return torch.cuda.memory_allocated()


def measure(model: GPT, seed: int) -> tuple[int, int, float]:
    """(bytes held after forward, peak bytes during the step, loss) of one step, both absolute."""
    tokens, labels = data(seed)
    model.zero_grad(set_to_none=False)  # gradient buffers exist before, so they are not counted as activations
    settle()
    torch.cuda.reset_peak_memory_stats()
    loss = gpt_loss(model(tokens), labels)
    held = settle()
    loss.backward()
    torch.cuda.synchronize()
    return held, torch.cuda.max_memory_allocated(), loss.item()


def grads_after_steps(model: GPT, steps: int = 2) -> list[torch.Tensor]:
    with sdpa_kernel(SDPBackend.MATH):  # the fused attention backwards accumulate with atomics: not bitwise
        for seed in range(steps):
            tokens, labels = data(seed)
            model.zero_grad(set_to_none=True)
            gpt_loss(model(tokens), labels).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("k", [12, 22])
@pytest.mark.parametrize("double_buffering", [False, True])
def test_peak_memory_drops_with_offloaded_share(k: int, double_buffering: bool) -> None:
    model = build()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    measure(model, 0)  # warm-up: kernels, cuBLAS workspace
    base = settle()  # parameters, gradients, workspaces: everything but activations
    held_0, peak_0, loss_0 = measure(model, 1)
    off = apply_activation_offloading(model, num_layers=k, double_buffering=double_buffering)
    measure(model, 0)  # warm-up: the pinned pool (and the double buffer) are allocated here
    pool = off.pool_bytes()
    _, peak_k, loss_k = measure(model, 1)  # the double buffer, kept between steps, counts in peak_k - base
    activations, drop = held_0 - base, peak_0 - peak_k
    mib = 2**20
    print(
        f"k={k} db={double_buffering}: activations {activations / mib:.0f} MiB, peak {(peak_0 - base) / mib:.0f} -> "
        f"{(peak_k - base) / mib:.0f} MiB, drop {drop / mib:.0f} MiB >= {0.9 * k / L * activations / mib:.0f} MiB"
    )
    assert drop >= 0.9 * k / L * activations
    assert off.pool_bytes() == pool  # no host allocation after the first iteration
    assert loss_0 == loss_k
    off.remove()


@pytest.mark.parametrize("k,double_buffering", [(12, False), (22, True)])
def test_gradients_bitwise_equal(k: int, double_buffering: bool) -> None:
    ref, model = build(), build()
    apply_activation_offloading(model, num_layers=k, double_buffering=double_buffering)
    for a, b in zip(grads_after_steps(ref), grads_after_steps(model), strict=True):
        assert torch.equal(a, b)


def test_autocast_weight_copies_leave_the_gpu() -> None:
    """fp32 parameters under bf16 autocast: weights=True frees autocast's bf16 weight copies after forward."""
    held = {}
    for weights in (False, True):
        torch.manual_seed(0)
        model = GPT(num_layers=L, hidden_size=H, num_attention_heads=HEADS, seq_length=S, vocab_size=V).cuda()
        off = apply_activation_offloading(model, num_layers=L - 1, weights=weights)
        tokens, labels = data(0)
        start = settle()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = gpt_loss(model(tokens), labels)
        held[weights] = settle() - start
        loss.backward()
        off.remove()
    casts = sum(2 * p.numel() for layer in model.layers[: L - 1] for p in layer.parameters() if p.dim() == 2)
    assert held[False] - held[True] >= 0.9 * casts


def test_fine_grained_gradients_bitwise_and_memory_drops() -> None:
    """Every layer's mlp offloaded: the mlp's saved tensors (most of a layer's) leave the GPU, gradients equal."""
    ref, model = build(), build()
    fg = apply_fine_grained_offloading(model, modules=("mlp",))
    for a, b in zip(grads_after_steps(ref), grads_after_steps(model), strict=True):
        assert torch.equal(a, b)
    held = {}
    for name, m in (("ref", ref), ("fg", model)):
        tokens, labels = data(3)
        start = settle()
        loss = gpt_loss(m(tokens), labels)
        held[name] = settle() - start
        loss.backward()
    mlp_share = 2 * B * S * 4 * H * 2 + B * S * H * 2  # fc1 output and gelu output (bf16), fc1 input, per layer
    assert held["ref"] - held["fg"] >= 0.9 * (L - 1) * mlp_share
    assert fg.host_bytes() == 0
