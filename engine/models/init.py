"""Meta-device construction: a model built on the meta device is given storage on its target device, in its
final dtype, and initialised there from seeded generators (torchtitan's pattern).

    with torch.device("meta"):
        model = GPT(...)                                 # shapes only: no storage, no random draws
    materialize(model, torch.device("cuda"), torch.bfloat16, seed=1234)   # bf16 on the GPU, initialised there

Initialisation (`init_transformer_`) is the GPT-2 / Megatron scheme by parameter name: matrices N(0, std), the
residual-output projections N(0, std / sqrt(2 * num_layers)), biases zero, norm weights one. Each parameter draws
from its own generator on its own device, seeded from (seed, parameter name): a tensor's values depend on the
seed, its name, its shape and the device type (CPU and CUDA generators differ), and on nothing else: not on the
optimizer, the offload settings, or which other parameters exist. Half-precision weights are drawn in fp32, one
chunk of at most `CHUNK` elements at a time, and rounded, so bf16/fp16 weights are exactly the fp32 ones rounded
and the transient is one chunk, never an fp32 copy of the model.
"""

from __future__ import annotations

import hashlib
import math
import queue
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

import torch
from torch import nn

CHUNK = 1 << 22  # elements drawn at once: bounds the fp32 transient of a half tensor at 16 MiB
NORM_WEIGHTS = ("norm.weight", "norm_weight")  # torch/megatron LayerNorm, TE's fused layer_norm_weight
OUTPUT_PROJECTIONS = ("proj.weight", "fc2.weight", "fc2_weight")  # attention out, MLP out (GPT, megatron, TE)


@runtime_checkable
class InitFromSeed(Protocol):
    """A model that initialises its own (materialised) parameters from a seed; the engine's models do."""

    def init_from_seed(self, seed: int) -> None: ...


def draw_seed() -> int:
    """A seed drawn from torch's default generator, so `torch.manual_seed(s)` before a build reproduces it."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


def param_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """A generator on `device` seeded from (seed, name): independent streams per parameter."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)


@torch.no_grad()  # here, not only in the caller: grad mode is per thread and this runs in a pool too
def normal_(p: torch.Tensor, std: float, generator: torch.Generator, scratch: torch.Tensor | None = None) -> None:
    """Fills p (any float dtype) with N(0, std) drawn in fp32 chunk by chunk along dim 0, rounded to p's dtype.

    scratch: fp32 [>= CHUNK] on p's device for the half draws, reused chunk after chunk (a fresh buffer per
    chunk grows the host heap: glibc keeps freed blocks of this size resident). None: one for this call."""
    if not p.is_contiguous():
        raise ValueError("normal_ needs a contiguous tensor (materialised parameters are)")
    rows = p.view(p.shape[0], -1)
    per = max(1, CHUNK // max(1, rows.shape[1]))
    if p.dtype != torch.float32 and scratch is None:
        scratch = torch.empty(min(p.numel(), per * rows.shape[1]), dtype=torch.float32, device=p.device)
    for r in range(0, rows.shape[0], per):
        part = rows[r : r + per]
        if part.dtype == torch.float32:
            part.normal_(0.0, std, generator=generator)
        else:
            draw = scratch[: part.numel()].view(part.shape)
            part.copy_(draw.normal_(0.0, std, generator=generator))


def init_transformer_(
    named_params: Iterable[tuple[str, torch.Tensor]],
    seed: int,
    *,
    std: float,
    num_layers: int,
    embedding_std: float | None = None,
    zero_centered_gamma: bool = False,
) -> None:
    """The GPT-2 / Megatron init by name over `named_params`, each from its own seeded generator (module doc).

    embedding_std: for parameters under an `embedding` module (default std). zero_centered_gamma: norm weights
    are stored as gamma - 1 (megatron's layernorm_zero_centered_gamma), so they start at zero."""
    out_std = std / math.sqrt(2.0 * num_layers)
    draws: dict[torch.device, list] = {}
    with torch.no_grad():
        for name, p in named_params:
            if p.is_meta:
                raise ValueError(f"{name} is still on the meta device: materialize the model before initialising it")
            if p.dim() < 2:
                p.fill_(1.0 if name.endswith(NORM_WEIGHTS) and not zero_centered_gamma else 0.0)
                continue
            if name.endswith(OUTPUT_PROJECTIONS):
                s = out_std
            elif "embedding" in name and embedding_std is not None:
                s = embedding_std
            else:
                s = std
            draws.setdefault(p.device, []).append((p, s, param_generator(seed, name, p.device)))
    for device, jobs in draws.items():
        # torch's CPU sampler is serial per generator; the generators are independent, so the host's parameters
        # draw on all threads with the same result. Each worker reuses one scratch chunk.
        workers = max(1, min(len(jobs), torch.get_num_threads())) if device.type == "cpu" else 1
        size = max(max(CHUNK, p[0].numel()) for p, _, _ in jobs)  # a chunk holds at least one row
        scratch: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(workers):
            scratch.put(torch.empty(size, dtype=torch.float32, device=device))

        def run(job: tuple, scratch: queue.SimpleQueue = scratch) -> None:
            buf = scratch.get()
            try:
                normal_(*job, scratch=buf)
            finally:
                scratch.put(buf)

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, jobs))


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is on the meta device (not yet materialised)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype | None, seed: int) -> nn.Module:
    """Gives every meta tensor of `model` uninitialised storage on `device` (floating ones in `dtype`), then
    initialises: `model.init_from_seed(seed)` where the model has it, else `reset_parameters()` of each module
    that held meta tensors (torch's convention; draws from torch's default generator). Tensors already on a real
    device are left as they are (Transformer Engine blocks built on the GPU, say). Buffers are allocated, not
    filled: a model with computed buffers fills them in its init_from_seed (the engine's models have none).
    Returns `model`."""
    meta_modules = [(n, m) for n, m in model.named_modules() if has_meta_direct(m)]
    if not isinstance(model, InitFromSeed):
        missing = [n or type(m).__name__ for n, m in meta_modules if not callable(getattr(m, "reset_parameters", None))]
        if missing:
            raise ValueError(
                f"model: {missing[0]!r} ({len(missing)} module(s) in all) holds meta-device tensors and has no "
                "reset_parameters(); give the model an init_from_seed(seed) method or build it on a real device"
            )

    _allocate(model, device, dtype)
    if isinstance(model, InitFromSeed):
        model.init_from_seed(seed)
    else:
        for _, m in meta_modules:
            m.reset_parameters()
    return model


def _allocate(model: nn.Module, device: torch.device, dtype: torch.dtype | None) -> None:
    """Module.to_empty for the meta tensors only, with a dtype, keeping what megatron-core and TE set on a
    parameter as attributes (tensor_model_parallel, partition_dim, ...: to_empty drops them) and tied weights tied."""
    new: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in new:
            cast = dtype if dtype is not None and t.is_floating_point() else None
            e = torch.empty_like(t, device=device, dtype=cast)
            if isinstance(t, nn.Parameter):
                e = nn.Parameter(e, requires_grad=t.requires_grad)
                e.__dict__.update(t.__dict__)
            new[id(t)] = e
        return new[id(t)]

    for m in model.modules():
        for key, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if t.is_meta:
                setattr(m, key, empty(t))


def has_meta_direct(module: nn.Module) -> bool:
    """Whether `module` itself (not its children) holds a meta parameter or buffer."""
    return any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))
