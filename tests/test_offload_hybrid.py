"""Activation offloading together with the hybrid optimizer: parameters bitwise those of the run without offloading.

The optimizer registers forward pre-hooks on layer units by name and copies updated weights into the parameters
in place; offloading keeps module names and parameter storage, so both compose.
"""

from __future__ import annotations

import pytest
import torch

from engine.models.gpt import GPT, gpt_loss
from engine.offload import apply_activation_offloading
from engine.optim import hybrid


def make() -> GPT:
    torch.manual_seed(0)
    return GPT(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("double_buffering", [False, True])
def test_hybrid_optimizer_with_offloading(double_buffering: bool, autocast: bool) -> None:
    runs = []
    for k in (0, 3):
        model = make()
        off = apply_activation_offloading(model, num_layers=k, double_buffering=double_buffering, min_bytes=0)
        opt = hybrid.HybridDeviceOptimizer(
            model.named_parameters(), hybrid.HybridOptions(lr=1e-2, weight_decay=0.1, offload_fraction=0.5,
            overlap_cpu_optimizer_d2h_h2d=True, cpu_threads=1)
        )  # fmt: skip
        opt.attach_model(model)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            tokens, labels = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = gpt_loss(model(tokens), labels)
            loss.backward()
            opt.clip_and_step(1.0)
            opt.zero_grad()
            losses.append(loss.detach())
        assert off.host_bytes() == 0
        opt.synchronize()  # CPU-stepped weights are written back asynchronously
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (losses_0, params_0), (losses_k, params_k) = runs
    assert all(torch.equal(a, b) for a, b in zip(losses_0, losses_k, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params_0, params_k, strict=True))
