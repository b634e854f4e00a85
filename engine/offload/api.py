"""The two entry points the engine calls once after building the model and moving it to its device."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from engine.messages import offloaded_layer_count
from engine.offload.discovery import describe_stacks, find_layer_stacks, find_submodules
from engine.offload.session import OffloadSession
from engine.offload.wrap import OffloadHandle

# saved storages this small stay on the device: LayerNorm statistics, RNG seeds, scalars. A copy this size
# costs its launch and event more than the PCIe time, and frees next to nothing.
DEFAULT_MIN_BYTES = 64 * 1024


def reload_lookahead(units: int, offloaded: int, *, double_buffering: bool = False, fine_grained: bool = False) -> int:
    """How many offloaded units backward reloads ahead of the one it computes (the memory plan calls this).

    Double buffering and fine-grained offloading: one (two slabs; one sub-module's group at a time). Otherwise
    as many as the non-offloaded units minus the one computing, so the reloaded units never hold more than the
    non-offloaded ones held at the end of forward."""
    if double_buffering or fine_grained:
        return 1
    return max(1, units - offloaded - 1)


def apply_activation_offloading(
    model: nn.Module,
    num_layers: int,
    activations: bool = True,
    weights: bool = False,
    double_buffering: bool = False,
    layers_path: str | Sequence[str] | None = None,
    *,
    min_bytes: int = DEFAULT_MIN_BYTES,
) -> OffloadHandle:
    """Offload what the first `num_layers` transformer layers save for backward (model.cpu_offloading).

    Layers are counted across every layer stack in forward order (an encoder-decoder's encoder layers first),
    so `num_layers` may be anything from 0 to the total minus one.

    activations: the layers' saved activations. weights: the weight copies they save (autocast's low-precision
    casts of the parameters, and views of them); parameters themselves are never copied, since a copy of a
    tensor that stays resident frees nothing. With fp32 or pure-bf16 parameters autograd saves the parameter
    itself, so `weights` has nothing to move there. double_buffering: reload into two reused device buffers,
    one layer ahead; without it, reloads run as far ahead as backward has freed memory for.
    """
    stacks = find_layer_stacks(model, layers_path)
    layers = [layer for _, stack in stacks for layer in stack]
    n = len(layers)
    counted = f"found {describe_stacks(stacks)}, counted in forward order"
    if (why := offloaded_layer_count(num_layers, n, counted)) is not None:
        raise ValueError(f"model.cpu_offloading_num_layers={num_layers}: {why}")
    paths = [p for p, stack in stacks for _ in stack]
    if num_layers == 0:
        return OffloadHandle(None, [], paths)
    session = OffloadSession(
        model, n, activations=activations, weights=weights, double_buffering=double_buffering,
        lookahead=reload_lookahead(n, num_layers, double_buffering=double_buffering), min_bytes=min_bytes,
    )  # fmt: skip
    handle = OffloadHandle(session, list(layers[:num_layers]), paths)
    for i, layer in enumerate(layers):
        if i < num_layers:
            handle.offload(layer, i)
        else:
            handle.mark(layer, i)
    return handle


def apply_fine_grained_offloading(
    model: nn.Module,
    modules: Sequence[str] = ("mlp",),
    layers_path: str | Sequence[str] | None = None,
    *,
    min_bytes: int = DEFAULT_MIN_BYTES,
) -> OffloadHandle:
    """Offload what the chosen sub-modules of every layer save (model.fine_grained_activation_offloading).

    modules: names relative to a layer ("attn_norm", "mlp", "attn.proj") or class names ("MLP"). Each chosen
    module's forward call is one group, reloaded one group ahead in backward. Interleaved micro-batches of a
    pipeline schedule are fine: each forward pass links only its own groups.
    """
    if not modules:
        raise ValueError(
            "model.offload_modules is empty: name the sub-modules of a layer to offload, "
            'e.g. ["attn_norm", "attn", "mlp_norm", "mlp"] for the built-in GPT'
        )
    stacks = find_layer_stacks(model, layers_path)
    layers = [layer for _, stack in stacks for layer in stack]
    found = [(p, m) for p, stack in stacks for layer in stack for _, m in find_submodules(layer, tuple(modules))]
    chosen = [m for _, m in found]
    if not chosen:
        names = sorted({name for layer in layers for name, _ in layer.named_modules() if name})
        raise ValueError(
            f"model.offload_modules={list(modules)} matches no sub-module of {type(layers[0]).__name__}; "
            f"its sub-modules are {names}"
        )
    session = OffloadSession(
        model, len(chosen), activations=True, weights=False, double_buffering=False,
        lookahead=reload_lookahead(len(chosen), len(chosen), fine_grained=True), min_bytes=min_bytes,
    )  # fmt: skip
    handle = OffloadHandle(session, chosen, [p for p, _ in found])
    for i, m in enumerate(chosen):
        handle.offload(m, i)
    return handle
