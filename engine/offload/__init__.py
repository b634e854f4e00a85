"""Activation offloading: what chosen layers save for backward lives in host memory between forward and backward.

    layers = find_layers(model)                                   # the ModuleList of transformer blocks
    off = apply_activation_offloading(model, num_layers=k)        # the first k layers, in place
    off.host_bytes(); off.remove()
    fg = apply_fine_grained_offloading(model, modules=("mlp",))   # chosen sub-modules of every layer

Module map: discovery (finding layers), pool (host buffers), transfers (streams or host copies), groups (one
forward call's saved tensors), session (policy and schedule), wrap (module wiring), api (these functions).
"""

from engine.offload.api import DEFAULT_MIN_BYTES, apply_activation_offloading, apply_fine_grained_offloading
from engine.offload.discovery import find_layers, find_submodules
from engine.offload.wrap import ActivationOffloadModule, OffloadHandle

__all__ = [
    "DEFAULT_MIN_BYTES",
    "ActivationOffloadModule",
    "OffloadHandle",
    "apply_activation_offloading",
    "apply_fine_grained_offloading",
    "find_layers",
    "find_submodules",
]
