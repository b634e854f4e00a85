"""The config's cross-field rules and the table of options whose mechanism is not built yet.

Each rule reads a namespace view of the validated raw config and yields `Problem`s; the reference's
constraints come first, with Megatron's exact messages. `engine.config` runs them and formats the errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple

from engine.config.schema import default, show
from engine.messages import (
    TE_NEEDS_CUDA,
    assist_needs_engine_adamw,
    heads_divide_hidden,
    offloaded_layer_count,
    recomputed_layer_count,
    unscaled_fp16_moments,
)

# --- cross-field rules: the reference's constraints first, then our own ----------------------------------


class Problem(NamedTuple):
    path: str  # the dotted key the message is about; its value is shown before the text
    text: str


Rule = Callable[[SimpleNamespace, int], Iterator[Problem]]
RULES: list[tuple[tuple[str, ...], Rule]] = []
WORLD_SIZE_RULES: list[Rule] = []  # the rules that read the data-parallel size: run again once it is known


def _rule(*reads: str, world_size: bool = False) -> Callable[[Rule], Rule]:
    """Register a rule with the paths it reads; it is skipped when one of them failed the schema. world_size: it
    reads the data-parallel size, so `engine.config.check_world_size` runs it again at the process group's size."""

    def register(fn: Rule) -> Rule:
        RULES.append((reads, fn))
        if world_size:
            WORLD_SIZE_RULES.append(fn)
        return fn

    return register


@_rule("model.cpu_offloading", "model.cpu_offloading_num_layers", "model.num_layers")
def _offloaded_layer_count(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    m = c.model
    if m.cpu_offloading_num_layers == "auto":  # the memory plan picks it, within range (_auto_needs_its_switch)
        return
    if m.cpu_offloading and (why := offloaded_layer_count(m.cpu_offloading_num_layers, m.num_layers)) is not None:
        yield Problem("model.cpu_offloading_num_layers", why)


@_rule(
    "model.cpu_offloading",
    "model.cpu_offloading_num_layers",
    "optimizer.optimizer_cpu_offload",
    "optimizer.optimizer_offload_fraction",
)
def _auto_needs_its_switch(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    # "auto" is resolved by the memory plan in initialize; it chooses among what the switch turns on
    if c.model.cpu_offloading_num_layers == "auto" and not c.model.cpu_offloading:
        yield Problem(
            "model.cpu_offloading_num_layers",
            "is chosen by the memory plan only with model.cpu_offloading=true; set it, or give a number",
        )
    if c.optimizer.optimizer_offload_fraction == "auto" and not c.optimizer.optimizer_cpu_offload:
        yield Problem(
            "optimizer.optimizer_offload_fraction",
            "is chosen by the memory plan only with optimizer.optimizer_cpu_offload=true; set it, or give a number",
        )


# Keys read only under a switch: set while it is off, each would be accepted and do nothing (Megatron ignores
# them), so each is refused. "auto" is _auto_needs_its_switch's.
CPU_PART_KEYS = ("optimizer.optimizer_offload_fraction", "optimizer.overlap_cpu_optimizer_d2h_h2d",
                 "optimizer.use_torch_optimizer_for_cpu_offload", "optimizer.pin_cpu_grads", "optimizer.pin_cpu_params",
                 "optimizer.cpu_optimizer_threads", "optimizer.cpu_optimizer_pin_threads",
                 "optimizer.speculation_buffer_mb")  # fmt: skip
SWITCHED_KEYS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("optimizer.optimizer_cpu_offload", "acts only on the CPU-stepped part, which exists only with", CPU_PART_KEYS),
    ("model.cpu_offloading", "acts only on offloaded layers, which exist only with",
     ("model.cpu_offloading_num_layers", "model.cpu_offloading_activations", "model.cpu_offloading_weights",
      "model.cpu_offloading_double_buffering")),
    ("optimizer.delayed_param_update", "counts the exact steps before the delayed update starts; it acts only with",
     ("optimizer.delayed_param_update_warmup",)),
    ("model.fused_linear_cross_entropy", "sizes the fused loss's chunks; it acts only with",
     ("model.fused_linear_cross_entropy_chunk_size",)),
)  # fmt: skip


@_rule(*(path for switch, _, keys in SWITCHED_KEYS for path in (switch, *keys)))
def _switched_keys_need_their_switch(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    for switch, what, keys in SWITCHED_KEYS:
        if _value(c, switch):
            continue
        for key in keys:
            if (value := _value(c, key)) != "auto" and value != (unset := default(key)):
                reset = f"unset {key}" if unset is None else f"set {key}={show(unset)} (the default)"
                yield Problem(key, f"{what} {switch}=true; set it, or {reset}")


def _value(c: SimpleNamespace, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(c, section), key)


@_rule("optimizer.optimizer", "optimizer.sgd_momentum", "optimizer.adam_beta1", "optimizer.adam_beta2",
       "optimizer.adam_eps")  # fmt: skip
def _other_optimizers_keys(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    o = c.optimizer
    others = ("sgd_momentum",) if o.optimizer == "adam" else ("adam_beta1", "adam_beta2", "adam_eps")
    for key in others:
        if getattr(o, key) != (unset := default(f"optimizer.{key}")):
            yield Problem(f"optimizer.{key}", f'is read only by the {"sgd" if o.optimizer == "adam" else "adam"} '
                          f'optimizer, not optimizer.optimizer="{o.optimizer}"; set optimizer.{key}={show(unset)} '
                          "(the default), or choose that optimizer")  # fmt: skip


@_rule("optimizer.lr_decay_style", "optimizer.min_lr")
def _min_lr_needs_a_decay(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.optimizer.lr_decay_style == "constant" and c.optimizer.min_lr != (unset := default("optimizer.min_lr")):
        yield Problem("optimizer.min_lr", 'is where a decaying schedule ends; optimizer.lr_decay_style="constant" '
                      f'never reaches it: set optimizer.lr_decay_style="cosine" or "linear", or '
                      f"optimizer.min_lr={show(unset)}")  # fmt: skip


@_rule("model.cpu_offloading", "model.pipeline_model_parallel_size")
def _offload_without_pipeline(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.model.cpu_offloading and c.model.pipeline_model_parallel_size > 1:
        yield Problem(
            "model.pipeline_model_parallel_size",
            "Currently there is no support for Pipeline parallelism with CPU offloading; "
            "set model.pipeline_model_parallel_size=1, "
            "or offload the optimizer instead (optimizer.optimizer_cpu_offload)",
        )


@_rule("model.cpu_offloading", "model.recompute_granularity", "model.recompute_num_layers")
def _offload_without_recompute(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    # a counted block of recomputed layers follows the offloaded ones, so no layer is both; every layer is not
    m = c.model
    if m.cpu_offloading and m.recompute_granularity is not None and m.recompute_num_layers is None:
        yield Problem(
            "model.recompute_granularity",
            "CPU offloading does not work when activation recomputation is enabled; "
            "set model.recompute_granularity=null or model.cpu_offloading=false "
            '(or recompute only layers that are not offloaded: model.recompute_num_layers, a number or "auto")',
        )


@_rule("model.recompute_num_layers", "model.recompute_granularity", "model.cpu_offloading",
       "model.cpu_offloading_num_layers", "model.num_layers", "model.implementation")  # fmt: skip
def _recomputed_layer_count(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    m = c.model
    r = m.recompute_num_layers
    if r is None:
        return
    if m.recompute_granularity != "full":
        yield Problem("model.recompute_num_layers", f'is read only with model.recompute_granularity="full" (now '
                      f"{m.recompute_granularity}); set it, or unset model.recompute_num_layers")  # fmt: skip
        return
    if m.implementation == "megatron" and m.cpu_offloading:
        yield Problem("model.recompute_num_layers", "CPU offloading does not work when activation recomputation "
                      "is enabled in megatron-core's GPT; set model.recompute_num_layers=null and "
                      "model.recompute_granularity=null, or model.cpu_offloading=false")  # fmt: skip
        return
    if c.model_in_hand or r == "auto":  # a model in hand: its layers are counted when they are wrapped
        return
    k = m.cpu_offloading_num_layers if m.cpu_offloading else None
    if k != "auto" and r > m.num_layers - (k or 0):
        yield Problem("model.recompute_num_layers", recomputed_layer_count(r, k, m.num_layers))


@_rule("model.cpu_offloading", "model.fine_grained_activation_offloading")
def _one_activation_offloading(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.model.fine_grained_activation_offloading and c.model.cpu_offloading:
        yield Problem(
            "model.fine_grained_activation_offloading",
            "fine_grained_activation_offloading cannot be enabled with cpu_offloading. "
            "Set model.fine_grained_activation_offloading=false or model.cpu_offloading=false",
        )


@_rule("model.cpu_offloading", "model.cuda_graph_impl")
def _offload_without_cuda_graphs(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.model.cpu_offloading and c.model.cuda_graph_impl != "none":
        yield Problem(
            "model.cuda_graph_impl",
            "CUDA graphs not supported with CPU offloading. "
            'Set model.cuda_graph_impl="none" or model.cpu_offloading=false',
        )


@_rule("optimizer.optimizer_cpu_offload", "optimizer.use_distributed_optimizer")
def _optimizer_offload_needs_distributed(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.optimizer.optimizer_cpu_offload and not c.optimizer.use_distributed_optimizer:
        yield Problem(
            "optimizer.optimizer_cpu_offload",
            "optimizer_cpu_offload requires use_distributed_optimizer=True (Megatron builds HybridDeviceOptimizer "
            "only inside the distributed optimizer); set optimizer.use_distributed_optimizer=true",
        )


@_rule("train.global_batch_size", "train.micro_batch_size", world_size=True)
def _batch_arithmetic(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    gbs, mbs = c.train.global_batch_size, c.train.micro_batch_size
    step = mbs * dp
    if gbs % step:
        nearest = max(1, round(gbs / step)) * step
        yield Problem(
            "train.global_batch_size",
            f"must be divisible by train.micro_batch_size ({mbs}) x data-parallel size ({dp}) = {step}; "
            f"set train.global_batch_size to a multiple of {step} (e.g. {nearest}) or lower train.micro_batch_size",
        )


@_rule("model.hidden_size", "model.num_attention_heads")
def _heads_divide_hidden(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if (why := heads_divide_hidden(c.model.hidden_size, c.model.num_attention_heads)) is not None:
        yield Problem("model.hidden_size", why)


@_rule("optimizer.lr", "optimizer.min_lr")
def _min_lr_below_lr(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.optimizer.min_lr > c.optimizer.lr:
        yield Problem("optimizer.min_lr", f"must be <= optimizer.lr ({c.optimizer.lr}); lower optimizer.min_lr")


@_rule("data.source", "data.path", "data.token_dtype")
def _file_sources_need_path(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    d = c.data
    if d.source in ("text", "tokens") and d.path is None:
        yield Problem("data.path", f'data.source="{d.source}" reads a file; set data.path to it or '
                                   'data.source="stdlib"')  # fmt: skip
    if d.source == "stdlib" and d.path is not None:
        yield Problem("data.path", 'is read only by data.source "text" or "tokens"; set data.source to the kind of '
                                   'file it is, or unset data.path')  # fmt: skip
    if d.source != "tokens" and d.token_dtype != "uint16":
        yield Problem("data.token_dtype", f'is read only by data.source "tokens", not "{d.source}"; '
                                          'unset data.token_dtype or set data.source="tokens"')  # fmt: skip


@_rule("train.params_dtype", "train.precision")
def _half_params_need_half_precision(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.train.params_dtype == "half" and c.train.precision not in ("bf16", "fp16"):
        yield Problem(
            "train.params_dtype",
            f'half weights need train.precision "bf16" or "fp16", not "{c.train.precision}"; '
            'set train.params_dtype="fp32" or train.precision="bf16"',
        )


@_rule("train.precision", "train.loss_scale", "train.initial_loss_scale", "train.loss_scale_window")
def _fp16_only_keys(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    # An fp16 knob under bf16/fp32 would be accepted and silently ignored; reject it instead.
    if c.train.precision == "fp16":
        return
    for key in ("loss_scale", "initial_loss_scale", "loss_scale_window"):
        if getattr(c.train, key) != (unset := default(f"train.{key}")):
            yield Problem(f"train.{key}", f'is used only with train.precision="fp16", not "{c.train.precision}"; '
                          f'set train.{key}={show(unset)} or train.precision="fp16"')  # fmt: skip


@_rule("model.fine_grained_activation_offloading", "model.offload_modules")
def _fine_grained_needs_modules(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.model.fine_grained_activation_offloading and not c.model.offload_modules:
        yield Problem(
            "model.offload_modules",
            'model.fine_grained_activation_offloading=true needs the sub-modules to offload; list them (e.g. ["mlp"])',
        )
    if c.model.offload_modules and not c.model.fine_grained_activation_offloading:
        yield Problem(
            "model.offload_modules",
            "are offloaded only with model.fine_grained_activation_offloading=true; "
            "set it, or set model.offload_modules=[]",
        )


@_rule(
    "optimizer.implementation",
    "optimizer.cpu_optimizer_threads",
    "optimizer.use_torch_optimizer_for_cpu_offload",
    "optimizer.delayed_param_update",
    "optimizer.cpu_offload_gpu_assist",
    "optimizer.cpu_optimizer_pin_threads",
)
def _megatron_optimizer_options(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    # megatron-core's builder picks its own CPU optimizer and threads: these would be silently ignored there
    if c.optimizer.implementation != "megatron":
        return
    o = c.optimizer
    for key, unset in (
        ("cpu_optimizer_threads", o.cpu_optimizer_threads is None),
        ("use_torch_optimizer_for_cpu_offload", not o.use_torch_optimizer_for_cpu_offload),
        ("delayed_param_update", not o.delayed_param_update),
        ("cpu_offload_gpu_assist", not o.cpu_offload_gpu_assist),
        ("cpu_optimizer_pin_threads", not o.cpu_optimizer_pin_threads),
    ):
        if not unset:
            yield Problem(
                f"optimizer.{key}",
                "applies only to optimizer.implementation='engine' (megatron-core's HybridDeviceOptimizer "
                f"does not read it); unset optimizer.{key} or use optimizer.implementation='engine'",
            )


@_rule(
    "optimizer.cpu_offload_gpu_assist",
    "optimizer.optimizer_cpu_offload",
    "optimizer.optimizer",
    "optimizer.use_torch_optimizer_for_cpu_offload",
)
def _gpu_assist_needs_engine_adam_offload(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    o = c.optimizer
    if not o.cpu_offload_gpu_assist:
        return
    if not o.optimizer_cpu_offload:
        yield Problem(
            "optimizer.cpu_offload_gpu_assist",
            "assists the CPU-stepped part, which exists only with optimizer.optimizer_cpu_offload=true; "
            "set it, or set optimizer.cpu_offload_gpu_assist=false",
        )
    elif (why := assist_needs_engine_adamw(o.optimizer, o.use_torch_optimizer_for_cpu_offload)) is not None:
        yield Problem("optimizer.cpu_offload_gpu_assist", why)


@_rule(
    "optimizer.use_precision_aware_optimizer",
    "optimizer.main_params_dtype",
    "optimizer.main_grads_dtype",
    "optimizer.exp_avg_dtype",
    "optimizer.exp_avg_sq_dtype",
    "optimizer.store_param_remainders",
    "train.precision",
    "train.params_dtype",
    "optimizer.delayed_param_update",
    "optimizer.implementation",
    "optimizer.optimizer",
    "optimizer.optimizer_cpu_offload",
    "optimizer.optimizer_offload_fraction",
    "optimizer.use_torch_optimizer_for_cpu_offload",
    "optimizer.cpu_offload_gpu_assist",
)
def _precision_aware_optimizer(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    o = c.optimizer
    if o.main_params_dtype != "fp32":
        yield Problem("optimizer.main_params_dtype", "is built for fp32 only (megatron's fp16 main parameters are "
                      "not); set optimizer.main_params_dtype='fp32'")  # fmt: skip
    if o.main_grads_dtype != "fp32":
        yield Problem("optimizer.main_grads_dtype", "is built for fp32 only; for bf16 gradient sums set "
                      "optimizer.accumulate_allreduce_grads_in_fp32=false and "
                      "optimizer.main_grads_dtype='fp32'")  # fmt: skip
    narrow = [k for k in ("exp_avg_dtype", "exp_avg_sq_dtype") if getattr(o, k) != "fp32"]
    for k in narrow:
        if getattr(o, k) == "fp8":
            yield Problem(f"optimizer.{k}", "fp8 states are not built here; use 'bf16' or 'int8_blockwise' "
                          "(block-wise 8-bit codes)")  # fmt: skip
        elif getattr(o, k) == "fp16":  # before the switch's rule: setting the switch would not make it work
            yield Problem(f"optimizer.{k}", unscaled_fp16_moments(k.removesuffix("_dtype"), "'bf16'"))
        elif not o.use_precision_aware_optimizer:
            yield Problem(f"optimizer.{k}", "needs optimizer.use_precision_aware_optimizer=true (as in megatron); "
                          f"set it, or set optimizer.{k}='fp32'")  # fmt: skip
        elif o.implementation != "engine" or o.optimizer != "adam" or o.use_torch_optimizer_for_cpu_offload:
            yield Problem(f"optimizer.{k}", "narrows the engine's own AdamW's states only (both parts of the split): "
                          "set optimizer.implementation='engine', optimizer.optimizer='adam' and "
                          f"use_torch_optimizer_for_cpu_offload=false, or optimizer.{k}='fp32'")  # fmt: skip
        elif o.cpu_offload_gpu_assist:
            yield Problem(f"optimizer.{k}", "does not combine with optimizer.cpu_offload_gpu_assist=true (the "
                          "assist streams fp32 states); set one of them back")  # fmt: skip
    if o.store_param_remainders:
        yield from _remainders(c)


def _remainders(c: SimpleNamespace) -> Iterator[Problem]:
    o, t, key = c.optimizer, c.train, "optimizer.store_param_remainders"
    why = None
    if not o.use_precision_aware_optimizer:
        why = "needs optimizer.use_precision_aware_optimizer=true (as in megatron)"
    elif t.precision != "bf16" or t.params_dtype != "half":
        why = (
            f"splits the master into the bf16 weight and a remainder; the weights here are "
            f"{'fp32' if t.params_dtype != 'half' else t.precision}: set train.precision='bf16' and "
            "train.params_dtype='half'"
        )
    elif o.implementation != "engine" or o.optimizer != "adam" or o.use_torch_optimizer_for_cpu_offload:
        why = (
            "is the engine's own AdamW's (both parts of the split): set optimizer.implementation='engine', "
            "optimizer.optimizer='adam' and use_torch_optimizer_for_cpu_offload=false"
        )
    elif o.cpu_offload_gpu_assist:
        why = "does not combine with optimizer.cpu_offload_gpu_assist=true (it streams fp32 masters); set one back"
    if why is not None:
        yield Problem(key, f"{why}, or set {key}=false")


@_rule(
    "optimizer.delayed_param_update",
    "optimizer.implementation",
    "optimizer.optimizer_cpu_offload",
    "optimizer.optimizer_offload_fraction",
    "optimizer.cpu_offload_gpu_assist",
    world_size=True,
)
def _delayed_update_needs_a_cpu_part(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    o = c.optimizer
    if not o.delayed_param_update or o.implementation != "engine":  # megatron's: its own rule says so
        return
    if not o.optimizer_cpu_offload or o.optimizer_offload_fraction == 0:
        yield Problem("optimizer.delayed_param_update", "delays the update of the CPU-stepped part, which exists only "
                      "with optimizer.optimizer_cpu_offload=true and optimizer.optimizer_offload_fraction > 0; set "
                      "them, or set optimizer.delayed_param_update=false")  # fmt: skip
    elif dp > 1:
        yield Problem("optimizer.delayed_param_update", f"is built for one rank; with {dp} data-parallel ranks the "
                      "distributed optimizer broadcasts each update as soon as it is made; set "
                      "optimizer.delayed_param_update=false or run one rank")  # fmt: skip
    if o.cpu_offload_gpu_assist:
        yield Problem("optimizer.delayed_param_update", "does not combine with optimizer.cpu_offload_gpu_assist=true "
                      "(the assist writes the weights in place); set one of them to false")  # fmt: skip


@_rule("optimizer.implementation", "optimizer.use_distributed_optimizer", world_size=True)
def _megatron_optimizer_unsharded(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    o = c.optimizer
    if o.implementation == "megatron" and o.use_distributed_optimizer and dp > 1:
        yield Problem("optimizer.use_distributed_optimizer", f"shards only optimizer.implementation='engine'; "
                      f"megatron-core's optimizer across {dp} data-parallel ranks is not built in offload-engine: "
                      "set optimizer.implementation='engine' or run one rank")  # fmt: skip


@_rule("model.cpu_offloading_layers_path", "model.cpu_offloading", "model.fine_grained_activation_offloading",
       "model.recompute_granularity")  # fmt: skip
def _layers_path_needs_offloading(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    m = c.model
    recomputes = c.model_in_hand and m.recompute_granularity == "full"  # wraps the layers found at the path
    if m.cpu_offloading_layers_path is not None and not (
        m.cpu_offloading or m.fine_grained_activation_offloading or recomputes
    ):
        yield Problem(
            "model.cpu_offloading_layers_path",
            "is read only by activation offloading; set model.cpu_offloading=true or "
            "model.fine_grained_activation_offloading=true, or unset it",
        )


@_rule("model.use_te", "model.implementation", "model.recompute_granularity", "train.device")
def _use_te(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    m = c.model
    if not m.use_te:
        return
    from engine.extras import te_missing

    if (why := te_missing()) is not None:
        yield Problem("model.use_te", f"{why}, or set model.use_te=false")
    elif c.train.device == "cpu":
        yield Problem("model.use_te", TE_NEEDS_CUDA)
    if m.implementation == "builtin" and m.recompute_granularity == "selective":
        yield Problem("model.recompute_granularity", 'the built-in GPT\'s selective recompute is not built for '
                      'Transformer Engine layers; set model.recompute_granularity="full" or null')  # fmt: skip


@_rule("train.fp8", "train.fp8_recipe", "model.use_te", "model.recompute_granularity", "train.device")
def _fp8(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    t = c.train
    if t.fp8 is None:
        return
    from engine.extras import te_missing
    from engine.precision import fp8_capability_problem

    if not c.model.use_te:
        yield Problem("train.fp8", "FP8 runs in Transformer Engine layers only; set model.use_te=true (the built-in "
                                   "GPT's TE layers, or megatron-core's TE spec), or train.fp8=null")  # fmt: skip
    elif (why := te_missing()) is not None:
        yield Problem("train.fp8", f"{why}, or set train.fp8=null")
    elif t.device == "cpu" or not _cuda():
        yield Problem("train.fp8", 'FP8 runs on CUDA only; set train.device="auto" or "cuda" on a GPU, or '
                                   "train.fp8=null")  # fmt: skip
    elif (why := fp8_capability_problem(t.fp8_recipe, _capability())) is not None:
        yield Problem("train.fp8_recipe" if t.fp8_recipe in ("mxfp8", "blockwise") else "train.fp8", why)
    if c.model.recompute_granularity is not None:
        yield Problem("model.recompute_granularity", "recompute re-runs layers in backward, outside the forward's "
                      "FP8 context; set model.recompute_granularity=null, or train.fp8=null")  # fmt: skip


@_rule("train.fp8", "train.fp8_recipe", "train.fp8_margin", "train.fp8_amax_history_len", "train.fp8_amax_compute_algo")
def _fp8_delayed_only_keys(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    from engine.precision import DELAYED_ONLY

    t = c.train
    if t.fp8 is None and t.fp8_recipe != (recipe := default("train.fp8_recipe")):
        yield Problem("train.fp8_recipe", f"acts only with train.fp8 set; set train.fp8, or set "
                                          f"train.fp8_recipe={show(recipe)} (the default)")  # fmt: skip
    for key, unset in DELAYED_ONLY.items():
        if getattr(t, key) != unset and (t.fp8 is None or t.fp8_recipe != "delayed"):
            yield Problem(f"train.{key}", f'acts only with train.fp8 set and train.fp8_recipe="delayed"; set those, '
                                          f"or unset train.{key}")  # fmt: skip


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _capability() -> tuple[int, int]:
    import torch

    return tuple(torch.cuda.get_device_capability())


@_rule("optimizer.lr_warmup_iters", "optimizer.lr_decay_iters", "train.train_iters")
def _warmup_within_the_schedule(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    # Megatron's rule: the warm-up lies within the schedule (lr_decay_iters, else train_iters), so a short run
    # may be the start of a longer schedule (train_iters=20 of a 20,000-iteration one, still warming up)
    o = c.optimizer
    limit, key = (o.lr_decay_iters, "optimizer.lr_decay_iters") if o.lr_decay_iters else (
        c.train.train_iters, "train.train_iters")  # fmt: skip
    if o.lr_warmup_iters > limit:
        yield Problem(
            "optimizer.lr_warmup_iters",
            f"must be <= {key} ({limit}); lower optimizer.lr_warmup_iters, or set optimizer.lr_decay_iters to "
            "the schedule's length",
        )


@_rule(
    "checkpoint.save",
    "checkpoint.save_interval",
    "checkpoint.keep_last",
    "checkpoint.load",
    "checkpoint.load_if_exists",
)
def _checkpoint_keys_need_their_folder(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    k = c.checkpoint
    for key, needs, used in (
        ("save_interval", "save", k.save_interval is not None),
        ("keep_last", "save", k.keep_last is not None),
        ("load_if_exists", "load", k.load_if_exists),
    ):
        if used and getattr(k, needs) is None:
            yield Problem(f"checkpoint.{key}", f"acts only with checkpoint.{needs} set; set checkpoint.{needs} "
                                               f"or unset checkpoint.{key}")  # fmt: skip


@_rule("logging.tensorboard_dir")
def _tensorboard_installed(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.logging.tensorboard_dir is None:
        return
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard writes through it)
    except ImportError:
        yield Problem(
            "logging.tensorboard_dir",
            "needs the tensorboard package: pip install 'offload-engine[tensorboard]', or unset it",
        )


# --- a model passed to engine.initialize: its shape comes from the model, not from model.* ------------------------

# the built-in GPT's shape and build: with a model in hand nothing reads them (seq_length and vocab_size are read
# by the built-in data too, so they stay); engine.user_model refuses them, and the layer count is checked against
# the discovered layers instead
BUILTIN_ONLY_KEYS = ("implementation", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "init_method_std", "use_te")  # fmt: skip
BUILTIN_ONLY_RULES = {"_offloaded_layer_count", "_heads_divide_hidden", "_use_te", "_fp8"}
USER_MODEL_RULES: list[tuple[tuple[str, ...], Rule]] = []


def _user_model_rule(*reads: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        USER_MODEL_RULES.append((reads, fn))
        return fn

    return register


def rules_for(model_in_hand: bool) -> list[tuple[tuple[str, ...], Rule]]:
    """The rules to run: every rule for the built-in GPT; with a model in hand, those not about the built-in's shape."""
    if not model_in_hand:
        return RULES
    return [r for r in RULES if r[1].__name__ not in BUILTIN_ONLY_RULES] + USER_MODEL_RULES


@_user_model_rule("model.recompute_granularity")
def _user_model_recompute(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.model.recompute_granularity == "selective":
        yield Problem(
            "model.recompute_granularity",
            "selective recompute is the built-in GPT's attention core; for a model of your own set "
            'model.recompute_granularity="full" (each layer under torch.utils.checkpoint) or null',
        )


@_user_model_rule("train.fp8")
def _user_model_fp8(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.train.fp8 is not None:
        yield Problem("train.fp8", "the engine puts FP8 only into the GPT it builds with Transformer Engine layers, "
                                   "not into a model of your own; build your model from TE modules under TE's own "
                                   "fp8_autocast, or set train.fp8=null")  # fmt: skip


def blocked(reads: Sequence[str], bad: set[str]) -> bool:
    """True when a path the rule reads (or its section, or one of its items) failed validation."""
    return any(r == b or r.startswith(b + ".") or b.startswith(r + "[") for r in reads for b in bad)


# --- options whose mechanism is not built yet: delete a row when its mechanism lands ------------------------


@dataclass(frozen=True)
class NotBuilt:
    path: str
    rejects: Callable[[Any, int], bool]  # (value, data_parallel_size) -> True when the value needs the mechanism
    what: str  # a whole sentence before " in offload-engine" ("... are not supported")
    fix: str


NOT_BUILT: tuple[NotBuilt, ...] = (
    NotBuilt("model.cuda_graph_impl", lambda v, dp: v != "none", "CUDA graphs are not supported",
             'set model.cuda_graph_impl="none"'),
    NotBuilt("model.pipeline_model_parallel_size", lambda v, dp: v > 1, "pipeline parallelism is not supported",
             "set model.pipeline_model_parallel_size=1"),
)  # fmt: skip
