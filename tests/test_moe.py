"""Mixture-of-experts models through the engine's user-model path with the hybrid optimizer, against torch's AdamW
in a hand-written loop:
  - HF Qwen3-MoE (transformers 5: each layer's experts are two 3-D parameters, [experts, out, in]): with the
    optimizer offloaded (an expert tensor stepped on the CPU) and with both offloads;
  - experts as a ModuleList (older HF MoEs, most hand-written ones): an expert no token reaches in a step gets no
    gradient, and torch's AdamW leaves it alone (no weight decay, no moment or step-count change). The engine must
    too, at every fraction and with the CPU step overlapped: bit for bit in its first step, and its later steps'
    bias correction from its own step count.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine

OFF = ["optimizer.optimizer_cpu_offload=true", "optimizer.use_distributed_optimizer=true"]
LR, WD = 1e-2, 0.1
STEPS, MICRO = 3, 2
CFG = {
    "optimizer": {"lr": LR, "weight_decay": WD, "clip_grad": 1.0, "lr_decay_style": "constant"},
    "train": {"train_iters": STEPS, "global_batch_size": 2 * MICRO, "micro_batch_size": 2, "precision": "fp32",
              "device": "cpu"},
    "logging": {"metrics_file": None, "progress_bar": False},
}  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread (conftest)


class ExpertLayer(nn.Module):
    """Top-1 routing by token id (expert = id % 4), so a batch decides which experts get gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x, out = self.norm(h), torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            routed = ids % 4 == e
            if routed.any():
                out[routed] = expert(x[routed])
        return h + out


class ListMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(ExpertLayer() for _ in range(3))
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, input_ids)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def list_batches() -> list[dict]:
    """Step 0 routes no token to expert 3; later steps route tokens to every expert."""
    g, out = torch.Generator().manual_seed(1), []
    for step in range(STEPS):
        for _ in range(MICRO):
            ids = torch.randint(0, 32, (2, 8), generator=g)
            if step == 0:
                ids = torch.where(ids % 4 == 3, ids - 3, ids)
            out.append({"input_ids": ids, "labels": torch.roll(ids, -1, 1)})
    return out


def reference(model: nn.Module, batches: list[dict], clip: float) -> tuple[list[float], dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}], lr=LR)
    losses, it = [], iter(batches)
    for _ in range(STEPS):
        total = 0.0
        for _ in range(MICRO):
            loss = model(**next(it))
            loss = loss.loss if hasattr(loss, "loss") else loss
            (loss / MICRO).backward()
            total += loss.item() / MICRO
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model.state_dict()


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_an_expert_without_tokens_is_left_alone_as_torch_adamw_does(fraction):
    batches = list_batches()
    ref_losses, ref_weights = reference(ListMoE(), batches, clip=1.0)
    over = [*OFF, f"optimizer.optimizer_offload_fraction={fraction}", "optimizer.overlap_cpu_optimizer_d2h_h2d=true"]
    eng, _, _ = engine.initialize(model=ListMoE(), config=CFG, overrides=over if fraction else [])
    init = {k: v.clone() for k, v in eng.module.state_dict().items()}
    it = iter(batches)
    losses = [eng.train_batch(it)]
    eng.synchronize()
    unused = [k for k in init if ".experts.3." in k]
    assert len(unused) == 6 and all(torch.equal(eng.module.state_dict()[k], init[k]) for k in unused)
    if fraction:
        assert any(".experts.3." in n for n in eng.optimizer.cpu_names)  # the CPU side has one to leave alone
    losses += [eng.train_batch(it) for _ in range(STEPS - 1)]
    eng.synchronize()
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    weights = eng.module.state_dict()
    for k, v in ref_weights.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6, msg=k)


def qwen3_moe():
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=64))  # fmt: skip


@pytest.mark.parametrize("extra", [[], ["model.cpu_offloading=true", "model.cpu_offloading_num_layers=2"]])
def test_hf_qwen3_moe_with_its_experts_stepped_on_the_cpu(extra):
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(STEPS * MICRO):
        ids = torch.randint(1, 128, (2, 64), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    ref_losses, ref_weights = reference(qwen3_moe(), batches, clip=1.0)
    over = [*OFF, "optimizer.optimizer_offload_fraction=0.5", "optimizer.overlap_cpu_optimizer_d2h_h2d=true", *extra]
    eng, _, _ = engine.initialize(model=qwen3_moe(), config=CFG, overrides=over)
    it = iter(batches)
    losses = [eng.train_batch(it) for _ in range(STEPS)]
    eng.synchronize()
    assert {n for n in eng.optimizer.cpu_names if n.endswith(("gate_up_proj", "down_proj"))}  # 3-D experts on the CPU
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    weights = eng.module.state_dict()
    for k, v in ref_weights.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_the_delayed_update_leaves_an_expert_without_tokens_alone():
    """optimizer.delayed_param_update: the CPU-stepped part's update lands a step late; after two steps step 0's
    has landed, and an expert no token reached in step 0 had none (not even weight decay) while the others moved."""
    over = [*OFF, "optimizer.optimizer_offload_fraction=1.0", "optimizer.delayed_param_update=true",
            "optimizer.delayed_param_update_warmup=0"]  # fmt: skip
    eng, _, _ = engine.initialize(model=ListMoE(), config=CFG, overrides=over)
    init = {k: v.clone() for k, v in eng.module.state_dict().items()}
    it = iter(list_batches())
    eng.train_batch(it)  # step 0 reaches no expert 3; its update lands during step 1, before step 1's update
    eng.train_batch(it)
    assert eng.last_step_delayed
    weights = eng.module.state_dict()
    assert all(torch.equal(weights[k], init[k]) for k in init if ".experts.3." in k)
    assert not torch.equal(weights["layers.0.experts.0.weight"], init["layers.0.experts.0.weight"])
