"""The optimizer tests' reference: a tiny GPT, its data, the plain-torch loop the hybrid optimizer must match."""

from __future__ import annotations

import copy
import time

import torch

from engine.models.gpt import GPT, gpt_loss
from engine.optim import HybridDeviceOptimizer, HybridOptions
from engine.optim.adam_math import Hyper

VOCAB, SEQ = 64, 16


def tiny_gpt(seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32, layers: int = 3) -> GPT:
    torch.manual_seed(seed)
    m = GPT(num_layers=layers, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB)
    return m.to(device=device, dtype=dtype)


def batches(steps: int, micro: int, device: str = "cpu", seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, VOCAB, (2, SEQ), generator=g).to(device) for _ in range(micro)] for _ in range(steps)]


def schedule(step: int) -> float:
    """Warmup over 3 steps, then linear decay: the LR changes every step."""
    return (step + 1) / 3 if step < 3 else max(0.1, 1.0 - (step - 3) / 20)


def groups(model: torch.nn.Module, wd: float, named: bool) -> list[dict]:
    """Two param groups: decayed matrices, and biases/norms without decay (their own hyperparameters)."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append((n, p) if named else p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3}]


# eps 1e-4, not 1e-8: the attention key bias gets pure rounding noise as its gradient (softmax ignores a
# shift of all keys), and Adam scales that noise up to steps of up to lr whose signs any change in
# rounding flips. Two correct kernels that differ in one rounding (the C pass rounds as torch's CUDA
# ops, the CPU reference as torch's CPU ops) then drift apart there: measured 1.07e-6 after 20 steps
# with eps 1e-5, 3.8e-7 with 1e-4 (everywhere else ~3e-7). So the runs compare to rounding, not noise.
HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-4)


def run_reference(model, data, *, max_norm: float, wd: float = 0.1, sgd: bool = False) -> torch.nn.Module:
    """fp32 torch AdamW (or SGD) with clip_grad_norm_ and LambdaLR: what the hybrid optimizer must reproduce."""
    model = copy.deepcopy(model)
    if sgd:
        opt = torch.optim.SGD(groups(model, wd, named=False), lr=HP["lr"], momentum=0.9)
    else:
        # the single-tensor implementation (CPU's default; on CUDA the default is foreach), whose CUDA
        # rounding the CPU pass reproduces
        opt = torch.optim.AdamW(groups(model, wd, named=False), **HP, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for micro in data:
        opt.zero_grad(set_to_none=True)
        for tokens in micro:
            (gpt_loss(model(tokens), tokens) / len(micro)).backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        sched.step()
    return model


def run_hybrid(model, data, *, max_norm: float, wd: float = 0.1, sgd: bool = False, start: int = 0, opt=None, **kw):
    """The same loop through HybridDeviceOptimizer; returns (model, optimizer)."""
    if opt is None:
        extra = dict(optimizer="sgd", momentum=0.9, lr=HP["lr"]) if sgd else dict(optimizer="adam", **HP)
        opt = HybridDeviceOptimizer(groups(model, wd, named=True), HybridOptions(**extra, **kw))
        opt.attach_model(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule, last_epoch=start - 1) if start == 0 else None
    if sched is None:  # resuming: the schedule continues where the checkpoint left it
        for g in opt.param_groups:
            g.setdefault("initial_lr", g["lr"])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule, last_epoch=start - 1)
    for micro in data:
        opt.zero_grad(set_to_none=True)
        for i, tokens in enumerate(micro):
            opt.set_grad_final(i == len(micro) - 1)
            (gpt_loss(model(tokens), tokens) / len(micro)).backward()
        norm, stepped = opt.clip_and_step(max_norm)
        assert stepped
        sched.step()
    opt.synchronize()
    return model, opt


def max_rel_err(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest |a - b| / max|b| per tensor; tensors whose entries are all below 1e-2 (young biases) count
    as scale 1e-2, so 1e-6 means 1e-8 absolute there rather than a ratio of rounding to near-zero."""
    worst = 0.0
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        err = (pa.detach().float() - pb.detach().float()).abs().max().item()
        worst = max(worst, err / max(pb.detach().float().abs().max().item(), 1e-2))
    return worst


def slow_cpu_threads(monkeypatch, counter: list[int]) -> None:
    """Slow the CPU threads' step and count the assist's units, so the GPU assist certainly takes some."""
    from engine.optim import cpu_arith, gpu_assist

    step_fused, step_unit = cpu_arith.FusedAdamW.step, gpu_assist.GpuAssist.step_unit

    def slow(self, *a, **kw):
        time.sleep(0.02)
        return step_fused(self, *a, **kw)

    def counted(self, *a, **kw):
        counter.append(1)
        return step_unit(self, *a, **kw)

    monkeypatch.setattr(cpu_arith.FusedAdamW, "step", slow)
    monkeypatch.setattr(gpu_assist.GpuAssist, "step_unit", counted)


def train_losses(model: torch.nn.Module, opt: HybridDeviceOptimizer, data) -> list[float]:
    """The built-in GPT trained on `data` ([tokens] per step) by the hybrid optimizer, clip 1.0: each step's loss."""
    losses = []
    for (tokens,) in data:
        opt.zero_grad(set_to_none=True)
        loss = gpt_loss(model(tokens), tokens)
        loss.backward()
        opt.clip_and_step(1.0)
        losses.append(loss.item())
    opt.synchronize()
    return losses


def reference_f64(p, m, v, g, h: Hyper, step: int, m_dtype, v_dtype):
    """AdamW in float64 from the stored (widened) states; moments rounded to nearest into their dtypes."""
    p, m, v, g = (t.double() for t in (p, m, v, g))
    p = p * (1 - h.lr * h.weight_decay)
    m = m + (1 - h.beta1) * (g - m)
    v = h.beta2 * v + (1 - h.beta2) * g * g
    denom = v.sqrt() / (1 - h.beta2**step) ** 0.5 + h.eps
    p = p - h.lr / (1 - h.beta1**step) * m / denom
    return p, m.to(m_dtype), v.to(v_dtype)
