"""megatron-core's optimizer for `optimizer.implementation="megatron"`, built the way Megatron builds it, behind
the engine's optimizer interface (`EngineOptimizer`, engine/optim/protocol.py).

With `optimizer.optimizer_cpu_offload` this is megatron-core's `HybridDeviceOptimizer` constructed exactly as
`megatron.core.optimizer._get_megatron_optimizer_based_on_param_groups` constructs it (the same in 0.16.x and
0.19.x): the GPU side is megatron's `Adam` (Transformer Engine's FusedAdam, else Apex's, else torch AdamW),
the CPU side torch AdamW, `param_update_in_fp32=True` (fp32 master copies of half params), the Adam
hyperparameters plus `bias_correction=True, fused=True` as group defaults, and the offload fraction, overlap
and pinning switches from the config. Without `optimizer_cpu_offload` it is megatron's plain `Adam` / `SGD`.

Half (bf16/fp16) weights are stepped through fp32, as Megatron's mixed-precision optimizer does: the gradients are
widened to fp32 before they are unscaled and clipped (a clip coefficient multiplied into a bf16 gradient would
round every element again), and the update is applied to an fp32 master. megatron's plain `Adam` steps whatever
tensors it is given, so the adapter gives it fp32 masters of the half weights and copies them back after each step
(saved as `fp32_from_fp16_params`, Megatron's name); the HybridDeviceOptimizer keeps its own fp32 copies
(`param_update_in_fp32=True`) and is handed the fp32 gradients through `decoupled_grad`, the attribute it reads
before `.grad`. Stepping bf16 weights in place instead loses every update below half a bf16 ulp.

megatron's `HybridDeviceOptimizer` is CUDA-only (it takes CUDA streams when built), so on CPU building it
raises an error that says so. Megatron's `use_torch_optimizer_for_cpu_offload` has no effect for Adam or
SGD in megatron-core (its builder overrides the classes it sets), and it has none here either.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.extras import require
from engine.optim.param_groups import named_parameter_groups
from engine.optim.protocol import unscale_and_clip_grads_

_log = logging.getLogger(__name__)

_GROUP_STEPS = "engine_sub_optimizer_group_steps"  # key of our state dict beside megatron's own

HDO_NEEDS_CUDA = (
    "optimizer.implementation='megatron' with optimizer.optimizer_cpu_offload=true needs CUDA: megatron-core's "
    "HybridDeviceOptimizer moves parameters between CUDA and pinned host memory on CUDA streams; "
    "on CPU use optimizer.implementation='engine'"
)


def megatron_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """megatron-core's default grouping (no weight decay for biases and 1-D parameters), bare tensors: the
    engine's one grouping, `engine.optim.param_groups.named_parameter_groups`."""
    return named_parameter_groups(model, None, weight_decay, named=False)


def _plain_groups(groups: Iterable[dict]) -> list[dict]:
    """Groups with bare tensors: the engine's builder passes (name, parameter) pairs, which megatron-core's
    optimizer (it re-splits groups into sub-optimizers by tensor) does not understand."""
    out = []
    for g in groups:
        g = dict(g)
        g["params"] = [p[1] if isinstance(p, tuple) else p for p in g["params"]]
        g.pop("param_names", None)
        out.append(g)
    return out


def build_megatron_optimizer(param_groups: Iterable[dict], cfg: Any) -> torch.optim.Optimizer:
    """megatron-core's optimizer over `param_groups` for our `optimizer.*` (an OptimizerConfig or alike)."""
    require("optimizer.implementation='megatron'")
    import megatron.core.optimizer as mopt

    groups = _plain_groups(param_groups)
    if cfg.optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer.optimizer={cfg.optimizer!r}: megatron-core's builder here takes adam or sgd")
    on_host = any(p.device.type != "cuda" for g in groups for p in g["params"])
    if not cfg.optimizer_cpu_offload:
        # with TE or Apex installed megatron's Adam and SGD are their fused CUDA kernels, which given host
        # tensors write through host pointers (seen on the H200: an illegal memory access); torch's on CPU
        torch_only = mopt.USING_PYTORCH_OPTIMIZER or on_host
        if cfg.optimizer == "sgd":
            sgd = torch.optim.SGD if torch_only else mopt.SGD
            return sgd(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.sgd_momentum)
        betas = (cfg.adam_beta1, cfg.adam_beta2)
        kwargs = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=betas, eps=cfg.adam_eps)
        if torch_only:
            return torch.optim.AdamW(groups, **kwargs)
        return mopt.Adam(groups, adam_w_mode=True, **kwargs)  # TE / Apex FusedAdam in AdamW mode
    if not torch.cuda.is_available() or on_host:
        raise RuntimeError(HDO_NEEDS_CUDA)
    if cfg.optimizer == "adam":
        gpu_cls, cpu_cls = mopt.Adam, torch.optim.AdamW
        defaults = dict(
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            bias_correction=True,
            fused=True,  # megatron sets it for the CPU side's torch AdamW
        )
    else:
        gpu_cls, cpu_cls = mopt.SGD, torch.optim.SGD
        defaults = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.sgd_momentum)
    return mopt.HybridDeviceOptimizer(
        groups,
        offload_fraction=cfg.optimizer_offload_fraction,
        cpu_optimizer_cls=cpu_cls,
        gpu_optimizer_cls=gpu_cls,
        overlap_cpu_optimizer_d2h_h2d=cfg.overlap_cpu_optimizer_d2h_h2d,
        pin_cpu_grads=cfg.pin_cpu_grads,
        pin_cpu_params=cfg.pin_cpu_params,
        param_update_in_fp32=True,
        **defaults,
    )


_MASTERS = "fp32_from_fp16_params"  # Megatron's key for the fp32 masters of half weights


def with_fp32_masters(groups: Iterable[dict]) -> tuple[list[dict], list[tuple[torch.Tensor, torch.Tensor]]]:
    """`groups` with every half parameter replaced by an fp32 master copy, and the (half weight, master) pairs."""
    out, pairs = [], []
    for g in _plain_groups(groups):
        params = []
        for p in g["params"]:
            if p.dtype in (torch.bfloat16, torch.float16):
                master = p.detach().float()
                pairs.append((p, master))
                p = master
            params.append(p)
        out.append({**g, "params": params})
    return out, pairs


class MegatronOptimizerAdapter(torch.optim.Optimizer):
    """EngineOptimizer (engine/optim/protocol.py) over a megatron-core optimizer (`inner`).

    It shares `inner`'s param-group dicts, so an LR schedule built on the adapter sets the lr `inner` uses
    (HybridDeviceOptimizer copies group settings into its sub-optimizers at every step). Optimizer state
    lives in `inner`; `state_dict`/`load_state_dict` are `inner`'s, plus the fp32 masters of `masters`
    ((half weight, fp32 master) pairs whose masters `inner` steps; module docstring).
    """

    def __init__(
        self, inner: torch.optim.Optimizer, masters: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> None:
        self.inner = inner
        self.masters = masters or []
        # torch.optim.Optimizer.add_param_group keeps each group dict it is given: the dicts are shared
        super().__init__(inner.param_groups, inner.defaults)

    def _fp32_grads(self) -> list[torch.Tensor]:
        """The gradients the step reads, each in fp32: half gradients widened into the masters' `.grad`, or into
        `decoupled_grad` for the HybridDeviceOptimizer's fp32 copies; fp32 gradients as they are."""
        for p, master in self.masters:
            master.grad = None if p.grad is None else p.grad.float()
        widen = bool(getattr(self.inner, "param_update_in_fp32", False))
        out = []
        for p in (q for g in self.param_groups for q in g["params"]):
            if p.grad is None:
                continue
            if widen and p.grad.dtype != torch.float32:
                p.decoupled_grad = p.grad.float()
                out.append(p.decoupled_grad)
            else:
                out.append(p.grad)
        return out

    def clip_and_step(
        self, max_norm: float, grad_scale: float = 1.0, *, finite: torch.Tensor | None = None
    ) -> tuple[float, bool]:
        """Unscale, clip the global L2 norm to `max_norm` (<= 0: no clipping), step `inner`.

        Returns (pre-clip unscaled gradient norm, stepped); a non-finite norm, or `finite` False, skips the step.
        Clipping over the model's gradients before `inner.step()` is what Megatron's FP32Optimizer does around it.
        """
        grads = self._fp32_grads()
        if not grads:
            return 0.0, False
        # the step's one synchronisation: skipping needs the norm on the host (Megatron syncs here too)
        d = unscale_and_clip_grads_(grads, max_norm, grad_scale, finite)
        if d.ok:
            self.step()  # through step: an LR schedule built on this adapter sees the step
        return d.norm, d.ok

    def step(self, closure: Any = None) -> Any:  # noqa: D102 - torch API: step without clipping
        if self.masters and all(m.grad is None for _, m in self.masters):
            self._fp32_grads()  # a bare step(), as torch's API allows: the masters read the weights' gradients
        out = self.inner.step(closure)
        if self.masters:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in self.masters], [m for _, m in self.masters])
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        self.inner.zero_grad(set_to_none)
        for p, _ in self.masters:  # the half weights are not in inner's groups: their gradients are ours to clear
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    # the rest of EngineOptimizer: megatron's optimizer hooks no layer and its step returns with the weights written
    last_step_delayed = False

    def attach_model(self, model: nn.Module) -> None:  # noqa: D102
        pass

    def set_grad_final(self, is_final: bool) -> None:  # noqa: D102
        pass

    def synchronize(self) -> None:  # noqa: D102
        pass

    def comm_hook(self) -> None:  # noqa: D102 - DDP's all-reduce
        return None

    def cpu_step_timing(self) -> None:  # noqa: D102 - megatron's CPU step, when offloaded, is not timed here
        return None

    def cpu_offload(self, micro_batches: int) -> None:  # noqa: D102 - not reported for megatron's optimizer
        return None

    def state_dict(self) -> dict:
        """`inner`'s state dict, loadable with `torch.load(weights_only=True)`: the optimizer classes that
        HybridDeviceOptimizer keeps in its groups are written as their names."""
        sd = self.inner.state_dict()
        for g in sd["param_groups"]:  # torch packs fresh group dicts: editing them leaves inner alone
            for k, v in g.items():
                if isinstance(v, type):
                    g[k] = f"{v.__module__}.{v.__qualname__}"
        # TE's and Apex's FusedAdam count steps in their groups ("step"), not per parameter, and megatron's
        # HybridDeviceOptimizer saves only its own groups: without this a load restarts their bias correction
        steps = [[g.get("step") for g in sub.param_groups] for sub in self._subs()]
        if any(st is not None for sub in steps for st in sub):
            sd[_GROUP_STEPS] = steps
        if self.masters:
            sd[_MASTERS] = [m for _, m in self.masters]
        return sd

    def _subs(self) -> list[torch.optim.Optimizer]:
        return list(getattr(self.inner, "sub_optimizers", None) or [self.inner])

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into `inner`, putting back the live classes `state_dict` wrote as names."""
        sd = {**state_dict, "param_groups": [dict(g) for g in state_dict["param_groups"]]}
        group_steps = sd.pop(_GROUP_STEPS, None)
        masters = sd.pop(_MASTERS, None)
        if self.masters:
            with torch.no_grad():  # a checkpoint without masters (saved before they existed): from the weights
                for (_, m), saved in zip(self.masters, masters or [p for p, _ in self.masters], strict=True):
                    m.copy_(saved)
            if masters is None:
                _log.warning("the checkpoint holds no fp32 masters of the half weights: they restart from the weights")
        for saved, live in zip(sd["param_groups"], self.inner.param_groups, strict=True):
            saved.update({k: v for k, v in live.items() if isinstance(v, type)})
        inner = self.inner
        if getattr(inner, "param_update_in_fp32", False) and not inner.param_to_fp32_param:
            # megatron's HybridDeviceOptimizer (0.16-0.19) refreshes fp32 copies after a load by indexing
            # param_to_fp32_param with every parameter; fp32 parameters have no copy there (a KeyError). With
            # every parameter fp32 the flag changes nothing else, so it is off for the load only.
            inner.param_update_in_fp32 = False
            try:
                inner.load_state_dict(sd)
            finally:
                inner.param_update_in_fp32 = True
        else:
            inner.load_state_dict(sd)
        # megatron's HybridDeviceOptimizer loads every state tensor onto the CPU, also those of GPU-stepped
        # parameters (seen on the H200: fused AdamW then refuses exp_avgs on cpu); put each beside its parameter
        # (the sub-optimizers hold the parameters that are stepped: fp32 copies on the CPU for offloaded ones)
        for sub in self._subs():
            # fused/capturable torch optimizers keep "step" beside the parameter, the others on the CPU. The flag
            # can sit in the sub-optimizer's defaults or its groups, and megatron-core copies the wrapper's group
            # settings (from the checkpoint) into the sub-optimizers at every step (seen on 0.19.2: a fused GPU
            # sub-optimizer then found "step" on the CPU), so every place is asked.
            groups = [sub.defaults, *sub.param_groups, *inner.param_groups]
            step_follows = any(g.get("fused") or g.get("capturable") for g in groups)
            for p, state in sub.state.items():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.device != p.device and (k != "step" or step_follows):
                        state[k] = v.to(p.device)
        if group_steps is not None:
            for sub, steps in zip(self._subs(), group_steps, strict=True):
                for g, step in zip(sub.param_groups, steps, strict=True):
                    if step is not None:  # a fresh FusedAdam has no "step" until its first step
                        g["step"] = step
        # torch's load builds new group dicts: share them again so the LR schedule keeps reaching inner
        self.param_groups = self.inner.param_groups

    def host_bytes(self) -> int:
        """Bytes of optimizer state, master and gradient copies that `inner` keeps in host memory."""
        seen: set[int] = set()
        total = 0
        subs = getattr(self.inner, "cpu_optimizers", [])
        tensors = [
            t
            for o in subs
            for p in (q for g in o.param_groups for q in g["params"])
            for t in [p, p.grad, *o.state.get(p, {}).values()]
            if isinstance(t, torch.Tensor)
        ]
        for t in tensors:
            if t.device.type == "cpu" and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total


def build_hybrid_optimizer(
    model: nn.Module, cfg: Any, param_groups: Iterable[dict] | None = None
) -> MegatronOptimizerAdapter:
    """megatron-core's optimizer for `model` under our `optimizer.*`, behind the engine's protocol.

    `param_groups` default to megatron's grouping (no decay on biases and 1-D params); the engine may pass
    its own groups (plain or (name, param) pairs). The model must already be on its device (CUDA for the
    offloading HybridDeviceOptimizer), since megatron splits parameters by where they live.
    """
    groups = megatron_param_groups(model, cfg.weight_decay) if param_groups is None else param_groups
    masters: list[tuple[torch.Tensor, torch.Tensor]] = []
    if not cfg.optimizer_cpu_offload:  # megatron's HybridDeviceOptimizer keeps its own fp32 copies
        groups, masters = with_fp32_masters(groups)
    return MegatronOptimizerAdapter(build_megatron_optimizer(groups, cfg), masters)
