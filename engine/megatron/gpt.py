"""A megatron-core `GPTModel` shaped by our `model.*`, behind an adapter with the built-in GPT's interface.

    model = build_gpt(cfg.model)              # MegatronGPT; model.gpt is the megatron-core GPTModel
    logits = model(tokens)                    # tokens [b, s] int64 -> logits [b, s, v]

The adapter is what lets the engine's loss (next-token cross entropy over [b, s, v]) and its loop run a
megatron-core model unchanged. megatron-core computes in [s, b, h] internally; `GPTModel.forward` without
labels returns logits already transposed to [b, s, v]. It takes explicit position ids and an attention mask;
the adapter passes positions 0..s-1 and no mask, and the local spec's causal mask type makes attention causal.

Layer discovery finds the transformer blocks at `model.gpt.decoder.layers` (also exposed, unregistered, as
`model.layers`, where the built-in GPT keeps them).

Construction never holds the model on the host for a CUDA run: the local spec is built on the meta device and
materialised on the target device in its final dtype; the Transformer Engine spec is allocated on the GPU by TE
and megatron-core, uninitialised. Both are then initialised by `MegatronGPT.init_from_seed`, the engine's seeded
init (engine.models.init) with megatron-core's default scheme (init_method_std, the output projections scaled by
1/sqrt(2 * num_layers), biases zero, norms one), so neither megatron's CPU nor its CUDA RNG tracker is drawn from.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

from engine.extras import require, require_te
from engine.megatron.parallel import ensure_model_parallel
from engine.messages import TE_NEEDS_CUDA
from engine.models.init import draw_seed, init_transformer_, materialize

log = logging.getLogger(__name__)

CORE_ATTENTION = ("auto", "megatron", "sdpa")
CPU_AUTOCAST_ERROR = (
    "model.implementation='megatron' on CPU cannot train under autocast (megatron-core's linear backward "
    "restores autocast for CUDA only): set train.precision='fp32', or train.params_dtype='half'"
)


class MegatronGPT(nn.Module):
    """forward(tokens [b, s]) -> logits [b, s, v] over a megatron-core GPTModel kept at `self.gpt`."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.gpt = gpt
        self.seq_length = gpt.max_sequence_length

    @property
    def layers(self) -> nn.ModuleList:
        """The transformer blocks (megatron's `decoder.layers`), where the built-in GPT keeps them."""
        return self.gpt.decoder.layers

    def init_from_seed(self, seed: int) -> None:
        """megatron-core's default init from the engine's per-parameter seeded generators (module doc)."""
        c = self.gpt.config
        init_transformer_(self.gpt.named_parameters(), seed, std=c.init_method_std, num_layers=c.num_layers,
                          embedding_std=c.embedding_init_method_std,
                          zero_centered_gamma=c.layernorm_zero_centered_gamma)  # fmt: skip

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [batch, seq] int64 -> logits [batch, seq, vocab]."""
        if tokens.device.type == "cpu" and torch.is_grad_enabled() and torch.is_autocast_enabled("cpu"):
            # megatron-core's linear layers restore autocast in backward for CUDA only, so a CPU autocast
            # forward meets an fp32 weight in backward; fail here with the fix rather than deep in autograd
            raise RuntimeError(CPU_AUTOCAST_ERROR)
        b, s = tokens.shape
        positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        # attention_mask=None: the causal mask type of the layer spec makes attention causal
        return self.gpt(tokens, positions, None)


def _get(model_cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(model_cfg, name, default)


def transformer_config(model_cfg: Any, **overrides: Any) -> Any:
    """megatron-core's TransformerConfig for our `model.*` shape (a ModelConfig or any object with its fields).

    Dropout is off, as in the built-in GPT, so runs with and without offloading are comparable step by step.
    `use_cpu_initialization` makes megatron-core allocate without naming a device, so a `torch.device("meta")`
    context catches every tensor (`build_gpt` initialises the weights afterwards, on the target device).
    """
    require("model.implementation='megatron'")
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute = _get(model_cfg, "recompute_granularity")
    kw: dict[str, Any] = dict(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        ffn_hidden_size=_get(model_cfg, "ffn_hidden_size") or 4 * model_cfg.hidden_size,
        init_method_std=_get(model_cfg, "init_method_std", 0.02),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        # megatron's own cpu_offloading stays off: the engine's activation offload does that job
        cpu_offloading=False,
    )
    count = _get(model_cfg, "recompute_num_layers")
    if recompute == "full" and count is not None:  # the first `count` layers (no offloading: the rules refuse it)
        kw.update(recompute_granularity="full", recompute_method="block", recompute_num_layers=int(count))
    elif recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        kw.update(recompute_granularity="selective")
    kw.update(overrides)
    return TransformerConfig(**kw)


def layer_spec(use_te: bool, core_attention: str, device: torch.device) -> Any:
    """The local spec (megatron-core modules only), its core attention swapped for SDPA where asked or on CPU;
    or, with `use_te`, megatron-core's Transformer Engine spec."""
    if core_attention not in CORE_ATTENTION:
        raise ValueError(f"core_attention={core_attention!r}: expected one of {CORE_ATTENTION}")
    if use_te:
        require_te("model.use_te=true")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec()
    use_sdpa = core_attention == "sdpa" or (core_attention == "auto" and device.type != "cuda")
    if core_attention == "megatron" and device.type != "cuda":
        raise RuntimeError(
            "megatron-core's DotProductAttention needs CUDA (it allocates its score buffer with "
            "torch.cuda.current_device()); on CPU use core_attention='sdpa' or 'auto'"
        )
    if use_sdpa:
        from engine.megatron.attention import SDPACoreAttention

        spec = copy.deepcopy(spec)
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def _with_torch_final_norm(spec: Any, num_layers: int) -> Any:
    """The whole block's spec, so the final norm is torch's too: given a layer's spec, megatron-core picks the
    final norm itself, TE's whenever TE imports, and TE's norm runs on CUDA only (the local spec on CPU fails)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    blocks = TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=WrappedTorchNorm)
    return ModuleSpec(module=TransformerBlock, submodules=blocks)


def build_gpt(
    model_cfg: Any,
    *,
    device: torch.device | str | None = None,
    seed: int | None = None,
    dtype: torch.dtype = torch.float32,
    core_attention: str = "auto",
    **config_overrides: Any,
) -> MegatronGPT:
    """A megatron-core GPTModel shaped by `model_cfg` (our `model.*`), wrapped in `MegatronGPT`.

    The model is built on `device` (default: CUDA if available) with its floating tensors in `dtype`, and
    initialised there from `seed` (None: drawn from torch's default generator, so `torch.manual_seed` before the
    call reproduces it; megatron's CUDA RNG tracker is then seeded with 1234). `core_attention`: "megatron"
    (megatron-core's DotProductAttention, CUDA only), "sdpa" (torch SDPA, any device) or "auto" (megatron's on
    CUDA, SDPA on CPU). Sets up megatron-core's parallel state first if nobody has. The output layer is untied
    from the embedding, as in the built-in GPT.
    """
    require("model.implementation='megatron'")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_te = bool(_get(model_cfg, "use_te", False))
    if use_te and dev.type != "cuda":
        raise RuntimeError(f"model.use_te=true: {TE_NEEDS_CUDA}")
    if _get(model_cfg, "recompute_granularity") and dev.type != "cuda":
        raise RuntimeError(
            "model.recompute_granularity with model.implementation='megatron' needs CUDA: megatron-core's "
            "recompute saves and restores CUDA RNG states; set model.recompute_granularity=null on CPU"
        )
    ensure_model_parallel(seed=1234 if seed is None else seed, device=dev)
    init_seed = draw_seed() if seed is None else seed
    spec = layer_spec(use_te, core_attention, dev)
    if use_te:
        # TE names its device itself (CPU under use_cpu_initialization): let it and megatron-core allocate on the
        # GPU in the final dtype, and skip their init (their CUDA tracker is not reseeded by a second build)
        # disable_parameter_transpose_cache: TE casts the weights to FP8 at every forward (the engine's optimizer
        # updates the bf16/fp32 weights between them; megatron's training loop, not ours, resets the cache per step)
        config_overrides = {"use_cpu_initialization": False, "perform_initialization": False, "params_dtype": dtype,
                            "disable_parameter_transpose_cache": True, **config_overrides}  # fmt: skip
    else:
        spec = _with_torch_final_norm(spec, model_cfg.num_layers)
    model = MegatronGPT(_gpt_model(model_cfg, spec, dev if use_te else torch.device("meta"), **config_overrides))
    if use_te:
        model.to(dtype)  # the few torch modules megatron-core builds in fp32 (the position embedding)
        model.init_from_seed(init_seed)
    else:
        # megatron-core ran its CPU init on meta tensors (free) so its parallel attributes are set as usual
        materialize(model, dev, dtype, init_seed)
    log.info("megatron: built GPTModel with %d layers (%s spec)", model_cfg.num_layers, "te" if use_te else "local")
    return model


def _gpt_model(model_cfg: Any, spec: Any, device: torch.device, **config_overrides: Any) -> nn.Module:
    from megatron.core.models.gpt import GPTModel

    with torch.device(device):
        return GPTModel(
            config=transformer_config(model_cfg, **config_overrides),
            transformer_layer_spec=spec,
            vocab_size=model_cfg.vocab_size,
            max_sequence_length=model_cfg.seq_length,
            share_embeddings_and_output_weights=False,
            position_embedding_type="learned_absolute",
        )


def meta_gpt(model_cfg: Any, *, seed: int = 1234, device: torch.device | str = "cpu") -> MegatronGPT:
    """The local-spec GPTModel of `model_cfg` on the meta device (names and shapes, no storage), for the memory
    plan. The Transformer Engine spec has the same elements: TE fuses each norm into the linear after it.
    `device` and `seed`: the run's, for megatron's parallel state if this sets it up first (build_gpt keeps it)."""
    require("model.implementation='megatron'")
    ensure_model_parallel(seed=seed, device=device)
    cpu = torch.device("cpu")
    spec = _with_torch_final_norm(layer_spec(False, "sdpa", cpu), model_cfg.num_layers)
    return MegatronGPT(_gpt_model(model_cfg, spec, torch.device("meta")))


def is_gpt_model(model: nn.Module) -> bool:
    """True for a megatron-core GPTModel (without importing megatron-core when it is absent)."""
    from engine.extras import is_megatron_gpt

    return is_megatron_gpt(model)


def as_engine_module(model: nn.Module, *, seed: int = 1234, device: torch.device | str | None = None) -> nn.Module:
    """A user's model as the engine runs it: a bare megatron-core GPTModel gets the `MegatronGPT` adapter (and
    megatron's parallel state / CUDA RNG tracker where missing); anything else is returned unchanged. A GPTModel
    built under `torch.device("meta")` stays there: the adapter's `init_from_seed` initialises it once
    `engine.models.init.materialize` has placed it (engine.initialize does both)."""
    if not is_gpt_model(model):
        return model
    ensure_model_parallel(seed=seed, device=device)
    return MegatronGPT(model)
