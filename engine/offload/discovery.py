"""Layer discovery: find the ModuleLists of transformer blocks (the layer stacks), and sub-modules inside them.

Order of search: explicit dotted paths, the built-in GPT's `layers`, megatron-core's `TransformerBlock.layers`
(when megatron-core is installed, else by class name), then every outermost ModuleList of repeated blocks
(where there are several, lists of bare torch.nn layers such as Linear heads are not stacks). An encoder-decoder
(T5, BART, Whisper) has two such stacks, found in registration order, which is the order they run in.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from torch import nn

_PATH_HINT = "set model.cpu_offloading_layers_path to the dotted path of the ModuleList of transformer layers"


def _resolve(model: nn.Module, path: str) -> nn.Module:
    obj: object = model
    for part in path.split("."):
        if isinstance(obj, (nn.ModuleList, nn.Sequential)) and part.isdigit():
            obj = obj[int(part)]
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            raise ValueError(
                f"model.cpu_offloading_layers_path={path!r}: {type(obj).__name__} has no attribute {part!r}"
            )
    if not isinstance(obj, (nn.ModuleList, nn.Sequential)):
        raise ValueError(f"model.cpu_offloading_layers_path={path!r} names a {type(obj).__name__}, not a ModuleList")
    return obj


def _megatron_blocks(model: nn.Module) -> list[nn.Module]:
    # a megatron-core model has imported megatron already: look it up rather than import it (slow, noisy);
    # the class name also matches wrappers and vendored copies
    mod = sys.modules.get("megatron.core.transformer.transformer_block")
    real = getattr(mod, "TransformerBlock", None)

    def is_block(m: nn.Module) -> bool:
        return (real is not None and isinstance(m, real)) or type(m).__name__ == "TransformerBlock"

    return [m for m in model.modules() if is_block(m) and isinstance(getattr(m, "layers", None), nn.ModuleList)]


def _is_torch_layer(m: nn.Module) -> bool:
    """A bare torch.nn building block (Linear, Embedding, LayerNorm, ...), not a transformer block."""
    return type(m).__module__.startswith("torch.nn.") and not any(True for _ in m.children())


def _repeated_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Outermost ModuleLists of >= 2 blocks of one type (a list inside a found one, like MoE experts, is skipped)."""
    found: list[tuple[str, nn.ModuleList]] = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < 2:
            continue
        # a block put under recompute is a subclass made for it (`_wraps`): still the same block
        if len({getattr(type(c), "_wraps", type(c)) for c in m}) != 1 or not any(True for _ in m[0].parameters()):
            continue
        if any(name.startswith(prefix + ".") for prefix, _ in found):
            continue
        found.append((name, m))
    return found


def _name_of(model: nn.Module, target: nn.Module) -> str:
    return next((n for n, m in model.named_modules() if m is target), "")


def find_layer_stacks(model: nn.Module, path: str | Sequence[str] | None = None) -> list[tuple[str, nn.ModuleList]]:
    """Every layer stack of `model` as (dotted path, ModuleList), in the order they run; ValueError if none.

    path: one dotted path or a list of them (model.cpu_offloading_layers_path), in forward order."""
    if path:
        paths = [path] if isinstance(path, str) else list(path)
        return [(p, _resolve(model, p)) for p in paths]
    from engine.models.gpt import GPT

    for m in model.modules():
        if isinstance(m, GPT):
            return [(_name_of(model, m.layers), m.layers)]
    blocks = _megatron_blocks(model)
    if len(blocks) == 1:
        return [(_name_of(model, blocks[0].layers), blocks[0].layers)]
    stacks = _repeated_lists(model)
    if len(stacks) > 1:  # several: the stacks of blocks (an encoder and a decoder), not lists of heads or norms
        stacks = [(p, layers) for p, layers in stacks if not _is_torch_layer(layers[0])]
    if not stacks:
        raise ValueError(
            f"no transformer layers found in {type(model).__name__}: no ModuleList of repeated blocks; {_PATH_HINT}"
        )
    return stacks


def describe_stacks(stacks: Sequence[tuple[str, nn.ModuleList]]) -> str:
    """'model.layers (22 x LlamaDecoderLayer)' or 'encoder.block (2 x T5Block), decoder.block (2 x T5Block)'."""
    return ", ".join(f"{p} ({len(layers)} x {type(layers[0]).__name__ if len(layers) else '-'})"
                     for p, layers in stacks)  # fmt: skip


def find_layers(model: nn.Module, path: str | None = None) -> nn.ModuleList:
    """The one ModuleList (or Sequential) of transformer layers of `model`; ValueError saying what to set if there
    is none, or several (`find_layer_stacks` returns them all)."""
    if path:
        return _resolve(model, path)
    from engine.models.gpt import GPT

    for m in model.modules():  # the built-in GPT, also inside wrappers (DDP's .module and the like)
        if isinstance(m, GPT):
            return m.layers
    blocks = _megatron_blocks(model)
    if len(blocks) == 1:
        return blocks[0].layers
    candidates = _repeated_lists(model)
    if len(candidates) == 1:
        return candidates[0][1]
    if not candidates:
        raise ValueError(
            f"no transformer layers found in {type(model).__name__}: no ModuleList of repeated blocks; {_PATH_HINT}"
        )
    names = ", ".join(repr(n) for n, _ in candidates)
    raise ValueError(f"several ModuleLists of repeated blocks in {type(model).__name__} ({names}); {_PATH_HINT}")


def find_submodules(layer: nn.Module, selectors: tuple[str, ...] | list[str]) -> list[tuple[str, nn.Module]]:
    """Sub-modules of one layer chosen by relative dotted name ("mlp", "attn.proj") or class name ("MLP").

    Returned in registration order (the order a block usually runs them). Overlapping choices are refused:
    saved-tensor hooks do not nest, so a module inside another chosen one would never be offloaded by the outer.
    """
    chosen: list[tuple[str, nn.Module]] = []
    for name, m in layer.named_modules():
        if name and (name in selectors or type(m).__name__ in selectors):
            for other, _ in chosen:
                if name.startswith(other + "."):
                    raise ValueError(f"model.offload_modules chooses both {other!r} and {name!r} inside it; choose one")
            chosen.append((name, m))
    return chosen
