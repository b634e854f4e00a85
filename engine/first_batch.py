"""What training builds around the placed model, and when: at `initialize`, or at the first micro-batch.

The activation offload, the full-recompute wrappers, the optimizer and its LR schedule depend on the memory plan
("auto" values, the pre-flight's refusal). A model of one's own given without `example_batch` is planned on the
first micro-batch the engine sees (`train_batch` or `forward`), before any optimizer state is allocated: there the
plan measures that micro-batch, the pre-flight refuses with its one line or resolves "auto", and then these are
built (`Pending.build`). Reading the optimizer or the schedule before that builds them at once when nothing waits
on the batch (no "auto"), with the pre-flight on weights and optimizer alone, the batch's activations checked at the
first micro-batch; with "auto" it says what is needed (`Pending.needed`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from engine import dist, user_model
from engine.build import build_optimizer
from engine.config import Config, ConfigError
from engine.optim.distributed import DistributedOptimizer
from engine.optim.param_groups import named_parameter_groups
from engine.optim.protocol import TorchOptimizer
from engine.planning import oom, preflight
from engine.planning.budget import Budgets
from engine.schedule import WarmupDecayLR

AUTO_KEYS = ("optimizer.optimizer_offload_fraction", "model.cpu_offloading_num_layers", "model.recompute_num_layers")


def auto_keys(cfg: Config) -> list[str]:
    """The keys of `cfg` set to "auto" (chosen by the plan)."""
    return [k for k in AUTO_KEYS if getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) == "auto"]


def activation_offloading(model: nn.Module, m: Any) -> Any:
    """The offload handle `model.cpu_offloading*` / `fine_grained_activation_offloading` ask for, or None."""
    from engine import offload

    if m.cpu_offloading:
        return offload.apply_activation_offloading(model, m.cpu_offloading_num_layers, m.cpu_offloading_activations,
                                                   m.cpu_offloading_weights, m.cpu_offloading_double_buffering,
                                                   m.cpu_offloading_layers_path)  # fmt: skip
    if m.fine_grained_activation_offloading:
        return offload.apply_fine_grained_offloading(model, m.offload_modules, m.cpu_offloading_layers_path)
    return None


def check_model_settings(model: nn.Module, m: Any) -> None:
    """Refuses now (one line naming the key) what the first micro-batch's build would refuse: full recompute and
    activation offload that cannot act on the model (a chosen number of offloaded layers is checked; "auto" is
    chosen in range). The offload is applied and removed again: nothing stays wrapped until the batch is measured."""
    user_model.prepare(model, m, wrap=False)
    if m.fine_grained_activation_offloading or (m.cpu_offloading and m.cpu_offloading_num_layers != "auto"):
        activation_offloading(model, m).remove()


def optimizer_for(model: nn.Module, model_parameters: Iterable[nn.Parameter] | None, cfg: Config, world: int
                  ) -> Any:  # fmt: skip
    """The optimizer `optimizer.*` describes over `model_parameters` (default: every trainable parameter)."""
    groups = named_parameter_groups(model, model_parameters, cfg.optimizer.weight_decay)
    if cfg.optimizer.use_distributed_optimizer and world > 1:
        return DistributedOptimizer(groups, lambda owned: build_optimizer(owned, cfg, model))
    return build_optimizer(groups, cfg, model)


def check_given_optimizer(cfg: Config, world: int) -> None:
    """A user's own optimizer where the config asks for the engine's: refused, naming the key."""
    if cfg.optimizer.use_distributed_optimizer and world > 1:
        raise ValueError("optimizer.use_distributed_optimizer=true shards its own optimizer; pass optimizer=None")
    if cfg.optimizer.optimizer_cpu_offload:
        raise ValueError("optimizer.optimizer_cpu_offload=true builds its own optimizer; pass optimizer=None")
    if cfg.train.params_dtype == "half":
        raise ValueError('train.params_dtype="half" keeps fp32 master weights in the engine\'s optimizer; '
                         'pass optimizer=None or set train.params_dtype="fp32"')  # fmt: skip


def schedule_for(optimizer: Any, cfg: Config) -> WarmupDecayLR:
    o = cfg.optimizer
    return WarmupDecayLR(optimizer, lr=o.lr, min_lr=o.min_lr, warmup_iters=o.lr_warmup_iters,
                         decay_iters=o.lr_decay_iters or cfg.train.train_iters, style=o.lr_decay_style)  # fmt: skip


@dataclass(frozen=True)
class Built:
    """What `build` made: the config with "auto" resolved, and the parts that depended on it."""

    cfg: Config
    optimizer: Any
    scheduler: WarmupDecayLR
    offloader: Any


def build(cfg: Config, model: nn.Module, optimizer: Any, model_parameters: Any, world: int,
          in_hand: bool) -> Built:  # fmt: skip
    """The parts training builds around the placed model, for a resolved `cfg` (`optimizer`: the user's, or None)."""
    if in_hand:
        user_model.prepare(model, cfg.model)  # full recompute of its layers
    offloader = activation_offloading(model, cfg.model)
    if optimizer is None:
        optimizer = optimizer_for(model, model_parameters, cfg, world)
    return Built(cfg, optimizer, schedule_for(optimizer, cfg), offloader)


@dataclass
class Pending:
    """A user's model given without example_batch: the plan, "auto" and the build wait for its first micro-batch."""

    cfg: Config  # as loaded: "auto" values not yet chosen
    model: nn.Module
    optimizer: Any  # the user's own, or None: the engine builds it
    model_parameters: Any
    device: torch.device
    world: int
    budgets: Budgets | None
    loss_fn: Any
    built_early: Built | None = None  # read before the first micro-batch (no "auto"): built, the batch checked later
    restore: list[Callable[[Any, Any], None]] = field(default_factory=list)  # checkpoint state for what is built

    @classmethod
    def start(cls, cfg: Config, model: nn.Module, *args: Any) -> Pending:
        """The wait begins: model settings that cannot act are refused now; the log says the plan waits."""
        check_model_settings(model, cfg.model)
        dist.log("memory plan: no example_batch given, so the first micro-batch is measured and checked (and "
                 'chooses "auto" values) before the optimizer\'s state is allocated')  # fmt: skip
        return cls(cfg, model, *args)

    def needed(self, what: str) -> str:
        """Why `what` cannot be had before the first micro-batch, and the fixes."""
        keys = auto_keys(self.cfg)
        chosen = " and ".join(f'{k}="auto"' for k in keys) + (" are" if len(keys) > 1 else " is")
        return (f"{what} is built at the first micro-batch: {chosen} chosen by the memory plan of that "
                "micro-batch; call eng.train_batch first, pass example_batch= (one micro-batch) to "
                "engine.initialize, or set a number")  # fmt: skip

    def early(self, what: str) -> Built:
        """The build before any micro-batch (the pre-flight without one), or ValueError naming what is needed."""
        if auto_keys(self.cfg):
            raise ValueError(self.needed(what))
        if self.built_early is None:
            cfg = preflight.check(self.cfg, self.model, self.device, self.world, self.budgets, None, self.loss_fn)
            self.built_early = build(cfg, self.model, self.optimizer, self.model_parameters, self.world, True)
        return self.built_early

    def at_batch(self, batch: Any) -> Built:
        """The plan of `batch`: refused with the pre-flight's one line, else "auto" chosen and the parts built."""
        cfg = agree(self.plan(batch), self.world)
        if self.built_early is not None:
            return replace(self.built_early, cfg=cfg)
        return build(cfg, self.model, self.optimizer, self.model_parameters, self.world, True)

    def plan(self, batch: Any) -> Config | Exception:
        """The pre-flight at `batch`: the config with "auto" chosen, or its refusal (raised once ranks agree)."""
        try:
            return preflight.check(self.cfg, self.model, self.device, self.world, self.budgets, batch, self.loss_fn,
                                   batch_name="first micro-batch")  # fmt: skip
        except ConfigError as e:
            return e
        except torch.OutOfMemoryError as e:  # the measuring forward keeps one layer's activations at a time
            where = "the memory plan's forward of the first micro-batch"
            error = oom.PlannedOutOfMemoryError(
                f"{oom.head(e, where)}, which holds one layer's activations at a time; lower "
                f"train.micro_batch_size (now {self.cfg.train.micro_batch_size}) or the micro-batch's sequence length"
            )
            error.__cause__ = e
            return error


def agree(result: Config | Exception, world: int) -> Config:
    """One decision for every rank: each planned its own micro-batch; a refusal on any rank is raised on all, and
    otherwise every rank takes the choice of the rank whose plan needs the most GPU memory."""
    if world > 1:
        mine = (str(result), None) if isinstance(result, Exception) else (None, _choice(result))
        every: list[Any] = [None] * world
        torch.distributed.all_gather_object(every, mine)
        refused = next(((r, e) for r, (e, _) in enumerate(every) if e is not None), None)
        if refused is not None and not isinstance(result, Exception):
            result = ConfigError([f"rank {refused[0]}: {refused[1]}"])
        if not isinstance(result, Exception):
            _, fraction, layers, recomputed = max((c for _, c in every), key=lambda c: c[0])
            o, m = result.optimizer, result.model
            result = replace(result, optimizer=replace(o, optimizer_offload_fraction=fraction),
                             model=replace(m, cpu_offloading_num_layers=layers,
                                           recompute_num_layers=recomputed))  # fmt: skip
    if isinstance(result, Exception):
        raise result
    return result


def _choice(cfg: Config) -> tuple[int, Any, Any, Any]:
    """(GPU bytes of this rank's plan, the values "auto" may choose)."""
    last = preflight.last()
    peak = last[1].gpu.total_bytes if last is not None else 0
    m = cfg.model
    return peak, cfg.optimizer.optimizer_offload_fraction, m.cpu_offloading_num_layers, m.recompute_num_layers


class Deferred:
    """What initialize returns for the optimizer and the LR schedule it builds at the first micro-batch: any
    attribute is the built one's (read before that micro-batch: built then, or ValueError naming what is needed)."""

    __slots__ = ("_get",)

    def __init__(self, get: Callable[[], Any]) -> None:
        object.__setattr__(self, "_get", get)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_get")(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_get")(), name, value)

    def __repr__(self) -> str:
        return "<built at the first micro-batch (engine.first_batch)>"


def raw(optimizer: Any) -> Any:
    """The optimizer as built: a torch optimizer out of the engine's adapter around it."""
    return optimizer.inner if isinstance(optimizer, TorchOptimizer) else optimizer
