"""One trainer per peer of `bin/bench peers`: `TRAINERS[name](spec, device) -> Trainer`.

Every trainer trains the spec's model on the same batches with AdamW (betas 0.9/0.95, eps 1e-8, the spec's lr
and weight decay), bf16 compute with fp32 master weights and Adam states, the gradients clipped to spec["clip"]
(0: unclipped) before the step. Each runs in its own process (engine/bench/peers/runner.py); a peer whose
package is missing raises, and the row says why.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.bench.peers import models

# what each peer's update is, against plain AdamW on the same gradients
ZENFLOW_INTERVAL = 4  # steps between ZenFlow's full CPU updates
# steps between a peer's periodic updates, where it has them: its ms/iter is the mean over its measured steps (a
# median would pick the steps without the update)
PERIODS = {"ds-zenflow": ZENFLOW_INTERVAL}
SEMANTICS = {
    "plain": "exact (the reference: torch AdamW, nothing offloaded)",
    "ours": "exact",
    "ours-delayed": "delayed (CPU-stepped parameters one step late)",
    "megatron": "exact",
    "ds-zero2": "exact",
    "ds-zero3-ratio": "exact",
    "ds-zenflow": "approximate (top-k important columns on the GPU each step, the rest accumulated, CPU every few)",
    "torchao": "exact",
    "fsdp2": "exact",
}


@dataclass
class Trainer:
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (inputs, labels) -> the loss, before the update
    close: Callable[[], None] = field(default=lambda: None)


def _adamw_kwargs(spec: dict) -> dict:
    return dict(lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=spec["weight_decay"])


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _clip(params, spec: dict) -> None:
    if spec["clip"] > 0:
        torch.nn.utils.clip_grad_norm_(params, spec["clip"])


def plain(spec: dict, device: torch.device) -> Trainer:
    """torch AdamW on fp32 parameters on the training device, bf16 autocast: the reference run."""
    model = models.build(spec, device)
    opt = torch.optim.AdamW(model.parameters(), **_adamw_kwargs(spec), fused=device.type == "cuda")

    def step(inputs, labels):
        opt.zero_grad(set_to_none=True)
        with _autocast(device):
            loss = models.loss(model, inputs, labels)
        loss.backward()
        _clip(model.parameters(), spec)
        opt.step()
        return loss

    return Trainer(step)


def _ours_config(spec: dict, delayed: bool) -> dict:
    f = spec["fraction"]
    cfg = {
        "model": {"seq_length": spec["seq"], "vocab_size": models.VOCAB},
        "optimizer": {"optimizer": "adam", "lr": spec["lr"], "weight_decay": spec["weight_decay"],
                      "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8, "clip_grad": spec["clip"],
                      "optimizer_cpu_offload": f > 0, "optimizer_offload_fraction": f,
                      "overlap_cpu_optimizer_d2h_h2d": f > 0, "use_distributed_optimizer": f > 0,
                      "cpu_optimizer_threads": spec["cpu_threads"] if f > 0 else None},
        "train": {"train_iters": spec["warmup"] + spec["iters"], "global_batch_size": spec["micro_batch"],
                  "micro_batch_size": spec["micro_batch"], "precision": "bf16", "params_dtype": "half",
                  "seed": spec["seed"]},
        "logging": {"metrics_file": None, "progress_bar": False},
    }  # fmt: skip
    if delayed:  # a warm-up as short as bin/bench scale's: the measured steps are delayed ones
        cfg["optimizer"].update(delayed_param_update=True, delayed_param_update_warmup=min(2, spec["warmup"]))
    return cfg


def ours(spec: dict, device: torch.device, delayed: bool = False) -> Trainer:
    """The engine's own training step (Engine.train_batch): bf16 weights, fp32 masters, `fraction` CPU-stepped."""
    from engine.engine import initialize

    eng, _, _ = initialize(model=models.build(spec, device, torch.bfloat16), config=_ours_config(spec, delayed))

    def step(inputs, labels):
        return torch.tensor(eng.train_batch(iter([(inputs, labels)])))

    return Trainer(step, close=lambda: (eng.synchronize(), getattr(eng.optimizer, "close", lambda: None)()))


def megatron(spec: dict, device: torch.device) -> Trainer:
    """megatron-core's HybridDeviceOptimizer, built by `bin/bench optimizer --compare megatron`'s own code."""
    from engine.bench import optimizer as bench_optimizer

    model = models.build(spec, device, torch.bfloat16)
    a = argparse.Namespace(lr=spec["lr"], weight_decay=spec["weight_decay"], clip_grad=spec["clip"],
                           cpu_threads=spec["cpu_threads"])  # fmt: skip
    opt, clip_and_step = bench_optimizer._build("megatron", spec["fraction"], model, a)

    def step(inputs, labels):
        opt.zero_grad(set_to_none=True)
        loss = models.loss(model, inputs, labels)
        loss.backward()
        clip_and_step()
        return loss

    return Trainer(step)


def _one_rank_group(device: torch.device) -> None:
    """A process group of this one process (DeepSpeed and FSDP2 need one)."""
    import torch.distributed as dist

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000), "RANK": "0",
                       "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():  # fmt: skip
        os.environ.setdefault(key, value)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def _deepspeed(spec: dict, device: torch.device, zero: dict) -> Trainer:
    import deepspeed

    _one_rank_group(device)
    config = {
        "train_micro_batch_size_per_gpu": spec["micro_batch"], "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True}, "gradient_clipping": spec["clip"], "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"], "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": spec["weight_decay"]}},
        "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
    }  # fmt: skip
    eng, _, _, _ = deepspeed.initialize(model=models.build(spec, device), config=config)

    def step(inputs, labels):
        loss = models.loss(eng, inputs, labels)
        eng.backward(loss)
        eng.step()
        return loss

    return Trainer(step, close=eng.destroy)


def ds_zero2(spec: dict, device: torch.device) -> Trainer:
    """DeepSpeed ZeRO-Offload: ZeRO-2 with offload_optimizer cpu (every Adam step on the CPU, DeepSpeedCPUAdam)."""
    return _deepspeed(spec, device, {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                     "overlap_comm": True, "contiguous_gradients": True})  # fmt: skip


def ds_zero3_ratio(spec: dict, device: torch.device) -> Trainer:
    """DeepSpeed ZeRO-3 with offload_optimizer `ratio` (Twin-Flow): that share of the Adam step on the CPU."""
    return _deepspeed(spec, device, {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                                       "ratio": spec["fraction"]}})  # fmt: skip


def ds_zenflow(spec: dict, device: torch.device) -> Trainer:
    """DeepSpeed ZenFlow: ZeRO-2 + CPU offload with importance-based (top-k) GPU updates, the rest on the CPU late."""
    import deepspeed

    if not hasattr(deepspeed.runtime, "zenflow") and not _has_module("deepspeed.runtime.zenflow"):
        raise RuntimeError(f"deepspeed {deepspeed.__version__} has no ZenFlow (deepspeed.runtime.zenflow)")
    return _deepspeed(spec, device, {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                     "overlap_comm": True, "contiguous_gradients": True,
                                     "zenflow": {"topk_ratio": 0.1, "update_interval": ZENFLOW_INTERVAL,
                                                 "full_warm_up_rounds": 0, "overlap_step": True}})  # fmt: skip


def _has_module(name: str) -> bool:
    import importlib.util

    with contextlib.suppress(ModuleNotFoundError):
        return importlib.util.find_spec(name) is not None
    return False


def torchao(spec: dict, device: torch.device) -> Trainer:
    """torchao's CPUOffloadOptimizer: fp32 parameters on the GPU, their Adam step on the CPU (torch AdamW there)."""
    from torchao.optim import CPUOffloadOptimizer

    model = models.build(spec, device)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=False, fused=True,
                              **_adamw_kwargs(spec))  # fmt: skip

    def step(inputs, labels):
        opt.zero_grad(set_to_none=True)
        with _autocast(device):
            loss = models.loss(model, inputs, labels)
        loss.backward()  # its hooks copy each gradient to the host as it is made: clip those copies
        torch.cuda.current_stream().synchronize()
        _clip(list(opt.param_d2h_map.values()), spec)
        opt.step()
        return loss

    return Trainer(step)


def fsdp2(spec: dict, device: torch.device) -> Trainer:
    """FSDP2 (fully_shard) on one rank with CPUOffloadPolicy: fp32 parameters and Adam on the host, bf16 compute."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    _one_rank_group(device)
    model = models.build(spec, device)
    policy = dict(offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda"),
                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))  # fmt: skip
    layers = model.layers if hasattr(model, "layers") else model.model.layers
    for layer in layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), **_adamw_kwargs(spec))

    def step(inputs, labels):
        opt.zero_grad(set_to_none=True)
        loss = models.loss(model, inputs, labels)
        loss.backward()
        _clip(model.parameters(), spec)
        opt.step()
        return loss

    return Trainer(step)


TRAINERS: dict[str, Callable[[dict, torch.device], Trainer]] = {
    "plain": plain,
    "ours": ours,
    "ours-delayed": lambda spec, device: ours(spec, device, delayed=True),
    "megatron": megatron,
    "ds-zero2": ds_zero2,
    "ds-zero3-ratio": ds_zero3_ratio,
    "ds-zenflow": ds_zenflow,
    "torchao": torchao,
    "fsdp2": fsdp2,
}
