"""What one micro-batch's forward saves for backward, storage by storage: the activation half of the memory plan.

Built-in GPT: a formula read off engine/models/gpt.py (every storage autograd saves, in the order the forward
saves it), exact for the CPU kernels (tests hold it equal to a forward under saved-tensor hooks) and, for CUDA,
with the two differences of CUDA's kernels: LayerNorm keeps fp32 statistics for half inputs, and fp32 attention
runs the memory-efficient kernel, whose logsumexp pads the sequence to a multiple of 32.

A user's model: measured, not derived. One layer (the first of `find_layers`) is run for real on the device its
weights are on, at batch 1 and three short sequence lengths, under saved-tensor hooks, and the forward is
stopped as soon as that layer returns; each saved storage's size is then fitted as c0 + c1*s + c2*s^2 and
evaluated at the configured sequence length (times the micro-batch). Why a small real forward and not the meta
device: meta tensors run neither autocast nor the real attention kernels (meta SDPA decomposes into the math
path and saves the s x s scores; autocast leaves meta tensors in fp32), so a meta forward misstates exactly
the bytes the plan is about; a real forward of one layer at <= 128 tokens costs milliseconds even for a large
model, allocates next to nothing, and runs the kernels training will run. The RNG state is restored afterwards,
so planning does not change the training run. A model on the meta device is measured on the meta device (the
only choice), which the plan notes. Tensors kept alive outside autograd (activation checkpointing's inputs)
are invisible to the hooks; a note says so when the model checkpoints.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class Saved:
    """One storage a forward saves for backward.

    owners: the (path relative to the layer, class name) of every module the saving op runs inside, outermost
    first; fine-grained offloading moves a storage when one of its owners is chosen."""

    what: str
    nbytes: int
    owners: tuple[tuple[str, str], ...] = ()
    weight_copy: bool = False  # autocast's half copy of a parameter (offloaded only with cpu_offloading_weights)


@dataclass(frozen=True)
class Activations:
    """The saved storages of one micro-batch: per transformer layer, and outside the layers."""

    layers: list[list[Saved]]
    head: list[Saved]  # embedding, final norm, output projection and loss
    logits_transient: int  # bytes beyond `head` at the forward/backward turn (logits, their fp32 copy, grads)
    backward_working: int  # temporaries of one layer's backward (the gradients flowing through it)
    recompute_working: int = 0  # full recompute: one layer's activations rebuilt during its backward
    checkpointed: tuple[Saved, ...] | None = None  # what a recomputed layer keeps (None: its first storage)
    source: str = "formula"
    notes: tuple[str, ...] = field(default_factory=tuple)

    def layer_bytes(self, i: int) -> int:
        return sum(s.nbytes for s in self.layers[i])


# --- the built-in GPT ----------------------------------------------------------------------------------------


def gpt_activations(
    *,
    num_layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    seq: int,
    vocab: int,
    micro_batch: int,
    precision: str,
    params_dtype: str,
    recompute: str | None,
    cuda: bool,
) -> Activations:
    """The built-in GPT's saved storages (engine/models/gpt.py), for a CUDA or a CPU device.

    a: bytes of what the matmuls compute in (2 under bf16/fp16, 4 under fp32); r: bytes of the residual stream
    (fp32 weights under autocast keep it fp32: embeddings are not autocast and x + half adds to fp32); t: the
    LayerNorm statistics (fp32 on CUDA, the input's dtype on CPU). Autocast also saves a half copy of every
    matmul weight (its cast, cached for the forward)."""
    b, s, h, f = micro_batch, seq, hidden, ffn
    n = b * s
    half_params = params_dtype == "half"
    autocast = precision != "fp32" and not half_params
    a = FP32 if precision == "fp32" else 2
    r = FP32 if (precision == "fp32" or autocast) else 2
    t = FP32 if cuda else r
    # CUDA's fp32 SDPA is the memory-efficient kernel: logsumexp [b, heads, ceil(s/32)*32]; flash (half, and
    # every CPU kernel): [b, heads, s]
    lse_seq = -(-s // 32) * 32 if (cuda and a == FP32) else s
    lse = b * heads * lse_seq * FP32

    def w(what: str, numel: int, path: str, cls: str) -> list[Saved]:
        return [Saved(what, numel * a, _owners(path, cls), weight_copy=True)] if autocast else []

    attn, mlp = ("attn", "CausalSelfAttention"), ("mlp", "MLP")
    full = [
        Saved("input", n * h * r, (("attn_norm", "LayerNorm"),)),
        Saved("attn_norm.mean", n * t, (("attn_norm", "LayerNorm"),)),
        Saved("attn_norm.rstd", n * t, (("attn_norm", "LayerNorm"),)),
        Saved("attn_norm.out", n * h * a, (attn, ("attn.qkv", "Linear"))),
        *w("attn.qkv.weight", 3 * h * h, "attn.qkv", "Linear"),
        Saved("attn.qkv.out", 3 * n * h * a, (attn,)),  # q, k, v: views of one storage
        *([Saved("attn.logsumexp", lse, (attn,))] if recompute != "selective" else []),
        Saved("attn.out", n * h * a, (attn,)),  # saved by SDPA and, as a view, by proj
        *w("attn.proj.weight", h * h, "attn.proj", "Linear"),
        Saved("residual", n * h * r, (("mlp_norm", "LayerNorm"),)),
        Saved("mlp_norm.mean", n * t, (("mlp_norm", "LayerNorm"),)),
        Saved("mlp_norm.rstd", n * t, (("mlp_norm", "LayerNorm"),)),
        Saved("mlp_norm.out", n * h * a, (mlp, ("mlp.fc1", "Linear"))),
        *w("mlp.fc1.weight", f * h, "mlp.fc1", "Linear"),
        Saved("mlp.fc1.out", n * f * a, (mlp,)),  # saved by gelu
        Saved("mlp.gelu.out", n * f * a, (mlp, ("mlp.fc2", "Linear"))),
        *w("mlp.fc2.weight", h * f, "mlp.fc2", "Linear"),
    ]
    # full recompute (the plan decides which layers): a recomputed layer keeps only its input (held by the
    # checkpoint); its backward rebuilds the rest
    checkpointed = (Saved("input (checkpointed layer)", n * h * r),)
    recompute_working = sum(x.nbytes for x in full)
    layer = full
    head = [
        Saved("tokens", n * INT64),
        Saved("positions", s * INT64),
        Saved("final_norm.input", n * h * r),
        Saved("final_norm.mean", n * t),
        Saved("final_norm.rstd", n * t),
        *([Saved("output.weight (autocast copy)", vocab * h * a, weight_copy=True)] if autocast else []),
        Saved("final_norm.out", n * h * a),
        Saved("log_softmax.out", n * vocab * FP32),
        Saved("labels", n * INT64),
        Saved("loss.total_weight", FP32),
    ]
    return Activations(
        layers=[layer] * num_layers,
        head=head,
        logits_transient=logits_transient(n, vocab),
        backward_working=backward_working(n, h, r, n * f * a),
        recompute_working=recompute_working,
        checkpointed=checkpointed,
        source="formula (built-in GPT)",
    )


def logits_transient(tokens: int, vocab: int) -> int:
    """Beyond the saved fp32 log-softmax: in backward its incoming gradient and its output, both fp32
    [tokens, vocab] (in forward, the half logits and their fp32 copy are at most as large)."""
    return 2 * tokens * vocab * FP32


def backward_working(tokens: int, hidden: int, r: int, largest: int) -> int:
    """Gradients alive inside one layer's backward: the incoming and outgoing residual gradient, and two
    gradients the size of the largest saved activation (the GPT's MLP: fc2's input gradient and gelu's)."""
    return 2 * tokens * hidden * r + 2 * largest


def _owners(path: str, cls: str) -> tuple[tuple[str, str], ...]:
    parent = path.rsplit(".", 1)[0]
    top = {"attn": "CausalSelfAttention", "mlp": "MLP"}.get(parent)
    return ((parent, top), (path, cls)) if top and parent != path else ((path, cls),)


# --- a user's model: one layer, measured ---------------------------------------------------------------------


class _Stop(Exception):
    """Raised from the measured layer's forward hook: nothing after it needs to run."""


def _default_input(batch: int, seq: int, device: torch.device) -> tuple[Any, ...]:
    return (torch.zeros(batch, seq, dtype=torch.long, device=device),)


def measure_layer_once(
    model: nn.Module,
    layer: nn.Module,
    seq: int,
    *,
    make_input: Callable[[int, int, torch.device], tuple[Any, ...]] = _default_input,
    autocast: contextlib.AbstractContextManager | None = None,
) -> list[Saved]:
    """The storages `layer` saves in a batch-1 forward of `model` at `seq` tokens (parameters excluded)."""
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    params = [*model.parameters(), *model.buffers()]
    param_refs = {StorageWeakRef(p.untyped_storage()) for p in params}
    param_ids = {id(p) for p in params}
    from engine.offload.groups import is_weight_copy

    stack: list[tuple[str, str]] = []
    seen: dict[StorageWeakRef, Saved] = {}
    active = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if active[0] and t.layout == torch.strided:
            key = StorageWeakRef(t.untyped_storage())
            if key not in param_refs and key not in seen:
                seen[key] = Saved(f"saved{len(seen)}", t.untyped_storage().nbytes(), tuple(stack),
                                  weight_copy=is_weight_copy(t, param_ids))  # fmt: skip
        return t

    def enter(m: nn.Module, a: Any, name: str) -> None:
        stack.append((name, type(m).__name__))

    def leave(m: nn.Module, a: Any, o: Any) -> None:  # returns None: a forward hook's result replaces the output
        stack.pop()

    def start(m: nn.Module, a: Any) -> None:
        active[0] = True

    handles = []
    for name, sub in layer.named_modules():
        if name:
            handles.append(sub.register_forward_pre_hook(functools.partial(enter, name=name)))
            handles.append(sub.register_forward_hook(leave))
    handles.append(layer.register_forward_pre_hook(start))

    def stop(m: nn.Module, a: Any, o: Any) -> None:
        raise _Stop

    handles.append(layer.register_forward_hook(stop))
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), autocast or contextlib.nullcontext():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(*make_input(1, seq, device))
    except _Stop:
        pass
    finally:
        for hd in handles:
            hd.remove()
    if not active[0]:
        raise ValueError(f"the forward of {type(model).__name__} did not run its layer {type(layer).__name__}")
    return list(seen.values())


def fit_to_length(samples: list[tuple[int, list[Saved]]], seq: int, micro_batch: int) -> list[Saved]:
    """Each storage's bytes at (micro_batch, seq) from batch-1 measurements at a few lengths.

    samples: [(length, storages)] for 1 to 3 lengths; the i-th storage of each is the same tensor. Weight
    copies do not grow with the batch; everything else is linear in it. With one sample it is taken as exact
    (measured at `seq` itself)."""
    if len({len(sv) for _, sv in samples}) != 1:
        raise ValueError("the layer saved a different number of tensors at different lengths")
    out = []
    for i, ref in enumerate(samples[-1][1]):
        xs = [float(s) for s, _ in samples]
        ys = [float(sv[i].nbytes) for _, sv in samples]
        if ref.weight_copy:
            out.append(ref)
            continue
        at = _poly_eval(xs, ys, float(seq))
        out.append(Saved(ref.what, max(0, round(at)) * micro_batch, ref.owners))
    return out


def _poly_eval(xs: list[float], ys: list[float], x: float) -> float:
    """Lagrange interpolation through the points (degree len(xs) - 1), evaluated at x."""
    total = 0.0
    for i, (xi, yi) in enumerate(zip(xs, ys, strict=True)):
        term = yi
        for j, xj in enumerate(xs):
            if j != i:
                term *= (x - xj) / (xi - xj)
        total += term
    return total


MEASURE_LENGTHS = (32, 64, 128)


def measured_activations(
    model: nn.Module,
    layers: nn.ModuleList,
    *,
    seq: int,
    micro_batch: int,
    hidden: int,
    vocab: int,
    a: int,
    r: int,
    autocast: contextlib.AbstractContextManager | None = None,
    make_input: Callable[[int, int, torch.device], tuple[Any, ...]] = _default_input,
) -> Activations:
    """A user's model: its first layer measured (see the module docstring), every layer taken to be alike.

    Outside the layers (not measured: the forward stops after the first layer) the plan counts the final
    norm's input and the output projection's input, [tokens, hidden] each in the residual and compute dtypes,
    the fp32 log-softmax of the loss and the labels; `hidden` and `vocab` come from the model's embeddings."""
    lengths = [seq] if seq <= MEASURE_LENGTHS[-1] else list(MEASURE_LENGTHS)
    samples = [(s, measure_layer_once(model, layers[0], s, make_input=make_input, autocast=autocast)) for s in lengths]
    layer = fit_to_length(samples, seq, micro_batch)
    n = micro_batch * seq
    head = [
        Saved("tokens", n * INT64),
        Saved("final_norm.input", n * hidden * r),
        Saved("output.input", n * hidden * a),
        Saved("log_softmax.out", n * vocab * FP32),
        Saved("labels", n * INT64),
    ]
    notes = []
    device = next(model.parameters()).device
    how = f"batch 1 at {'/'.join(map(str, lengths))} tokens on {device.type}"
    if device.type == "meta":
        notes.append("activations measured on the meta device: attention and autocast are approximated")
    if any("checkpoint" in type(m).__name__.lower() for m in model.modules()):
        notes.append("activation checkpointing keeps its inputs outside autograd: the plan does not see them")
    largest = max((x.nbytes for x in layer if not x.weight_copy), default=0)
    return Activations(
        layers=[layer] * len(layers),
        head=head,
        logits_transient=logits_transient(n, vocab),
        backward_working=backward_working(n, hidden, r, largest),
        source=f"measured ({how})",
        notes=tuple(notes),
    )
