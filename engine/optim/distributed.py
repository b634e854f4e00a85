"""The distributed optimizer (ZeRO stage 1): each data-parallel rank owns whole parameter tensors holding
about 1/N of the elements, and only it keeps their master weights and optimizer states.

The per-rank inner optimizer is any optimizer built over the rank's owned (name, parameter) groups: torch's
AdamW from `engine.build.build_optimizer`, or the HybridDeviceOptimizer, whose offload fraction then applies to
the rank's shard, so its host memory per rank falls by N too. One step:

  gradients      reduced in DDP's buckets while backward runs, each tensor to its owner only (`ddp_comm_hook`:
                 a reduce per owner and bucket, half the traffic of an all-reduce); without the hook (a
                 plain DDP all-reduce) the result is the same
  clip_and_step  each rank takes the squared norm of its owned gradients; one all-reduce makes the global
                 norm (the synchronisation clipping and the fp16 finite check need); the inner optimizer
                 steps the owned parameters, unscaled and clipped
  gather         each owner broadcasts its updated parameters, so every rank holds the whole model again

`state_dict()` gathers the shards to rank 0 and returns what the inner optimizer would return had it been built
over every parameter (torch's format, or the hybrid optimizer's name-keyed one), so a checkpoint does not
depend on the number of ranks, on the sharding, or on whether the run was sharded at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist

from engine.optim.hybrid import clear_grads
from engine.optim.protocol import CpuOffload, EngineOptimizer, as_engine_optimizer, decide

_NOT_HYPER = ("params", "param_names")


def partition(numels: list[int], world_size: int) -> list[int]:
    """Owner rank of each tensor: largest first onto the least-loaded rank (ties to the lower rank and to the
    earlier tensor), so every rank computes the same balanced answer without talking to the others."""
    load = [0] * world_size
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += numels[i]
    return owner


def _hypers(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


class DistributedOptimizer(torch.optim.Optimizer):
    """Shards `build(owned_groups)` across the ranks of `group` (default: the whole world).

    `named_groups` are torch-style param groups whose "params" are (name, parameter) pairs, the same on every
    rank; names key the state dict. `param_groups` (what LR schedulers set) cover every parameter, and their
    hyperparameters are handed to the inner optimizer before each step.
    """

    def __init__(self, named_groups: list[dict], build: Callable[[list[dict]], Any], group: Any = None) -> None:
        self.group = group
        self.world_size = tdist.get_world_size(group) if tdist.is_initialized() else 1
        self.rank = tdist.get_rank(group) if tdist.is_initialized() else 0
        self.group_names = [[n for n, _ in g["params"]] for g in named_groups]
        named = [pair for g in named_groups for pair in g["params"]]
        self.names = [n for n, _ in named]
        if len(set(self.names)) != len(self.names):
            raise ValueError("DistributedOptimizer: parameter names must be unique")
        self.params_by_name = dict(named)
        self._owner_of_param: dict[int, int] = {}
        owners = partition([p.numel() for _, p in named], self.world_size)
        self.owner = dict(zip(self.names, owners, strict=True))
        self._owner_of_param = {id(p): r for (_, p), r in zip(named, owners, strict=True)}
        if self.rank not in owners:
            raise ValueError(f"distributed optimizer: {self.world_size} ranks but only {len(named)} parameter tensors; "
                             "use fewer ranks or optimizer.use_distributed_optimizer=false")  # fmt: skip
        owned_groups = [{**g, "params": [(n, p) for n, p in g["params"] if self.owner[n] == self.rank]}
                        for g in named_groups]  # fmt: skip
        self.inner_to_full = [i for i, g in enumerate(owned_groups) if g["params"]]
        self.owned = [p for i in self.inner_to_full for _, p in owned_groups[i]["params"]]
        inner = build([owned_groups[i] for i in self.inner_to_full])  # torch rewrites these dicts in place
        self.inner: EngineOptimizer = as_engine_optimizer(inner)
        super().__init__([{**_hypers(g), "params": [p for _, p in g["params"]]} for g in named_groups],
                         dict(inner.defaults))  # fmt: skip
        # per owner rank, its parameters by dtype in model order: the unit of the post-step broadcast
        self._by_owner: list[dict[torch.dtype, list[torch.Tensor]]] = [{} for _ in range(self.world_size)]
        for n, p in named:
            self._by_owner[self.owner[n]].setdefault(p.dtype, []).append(p)

    # ---------------------------------------------------------------- gradient reduction
    def ddp_comm_hook(self, _state, bucket):  # no annotations: DDP rejects string ones
        """A DDP communication hook, (state, dist.GradBucket) -> Future[Tensor]: averages each gradient of the
        bucket onto the rank that owns it (the reduce-scatter of ZeRO, cut along whole tensors). The other ranks'
        copies are left partial and never read: clipping and the step use owned gradients only."""
        buf = bucket.buffer()
        buf.div_(self.world_size)
        by_owner: dict[int, list[torch.Tensor]] = {}
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            by_owner.setdefault(self._owner_of_param[id(p)], []).append(g)
        pending = []
        for r in sorted(by_owner):  # the same order on every rank: DDP's buckets are the same everywhere
            gs = by_owner[r]
            flat = torch.cat([g.reshape(-1) for g in gs])
            dst = tdist.get_global_rank(self.group, r) if self.group is not None else r
            pending.append((r, gs, flat, tdist.reduce(flat, dst=dst, group=self.group, async_op=True)))

        def unpack(_: Any) -> torch.Tensor:
            for r, gs, flat, _work in pending:
                if r == self.rank:
                    chunks = flat.split([g.numel() for g in gs])
                    torch._foreach_copy_(gs, [c.view_as(g) for g, c in zip(gs, chunks, strict=True)])
            return buf  # the gradients are views of it

        return torch.futures.collect_all([work.get_future() for *_, work in pending]).then(unpack)

    # ---------------------------------------------------------------- what the engine calls
    def set_grad_final(self, is_final: bool) -> None:
        # Across ranks a gradient is final only once DDP has reduced it, after every backward hook ran: an
        # inner optimizer that ships gradients from its hooks (the hybrid one) must wait for the step.
        self.inner.set_grad_final(is_final and self.world_size == 1)

    def attach_model(self, model: torch.nn.Module) -> None:
        self.inner.attach_model(model)

    def synchronize(self) -> None:
        self.inner.synchronize()

    @property
    def last_step_delayed(self) -> bool:
        return self.inner.last_step_delayed

    def host_bytes(self) -> int:
        return self.inner.host_bytes()

    def cpu_step_timing(self) -> dict[str, float] | None:
        return self.inner.cpu_step_timing()  # this rank's CPU step

    def cpu_offload(self, micro_batches: int) -> CpuOffload | None:
        return self.inner.cpu_offload(micro_batches)  # this rank's shard

    def comm_hook(self) -> Callable:
        """`ddp_comm_hook`: each gradient reduced to its owner (EngineOptimizer)."""
        return self.ddp_comm_hook

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)  # the inner optimizer's own bookkeeping
        clear_grads(self.params_by_name.values(), set_to_none)

    def clip_and_step(
        self, max_norm: float, grad_scale: float = 1.0, *, finite: torch.Tensor | None = None
    ) -> tuple[float, bool]:
        """Unscale by grad_scale, clip the global L2 norm to max_norm (0: no clipping), step the owned shard,
        gather the updated parameters. Returns (global pre-clip norm, stepped); on a non-finite norm, or `finite`
        False, every rank skips the step (they all see the same norm; `finite` must be the same on every rank)."""
        return self.step(max_norm=max_norm, grad_scale=grad_scale, finite=finite)  # through step: LR schedulers

    @torch.no_grad()
    def step(
        self, closure: Any = None, *, max_norm: float = 0.0, grad_scale: float = 1.0, finite: torch.Tensor | None = None
    ) -> tuple[float, bool]:
        """torch.optim's step (no closure): clip_and_step's update, unclipped unless max_norm is given."""
        if closure is not None:
            raise ValueError("DistributedOptimizer.step does not take a closure")
        grads = [p.grad for p in self.owned if p.grad is not None]
        device = self.owned[0].device
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads])
            sq = torch.linalg.vector_norm(norms, 2.0).float() ** 2
        else:
            sq = torch.zeros((), device=device)
        if self.world_size > 1:
            # THE synchronisation of the step: clipping and the finite check need the global norm
            tdist.all_reduce(sq, group=self.group)
        total_f, coef_f, ok = decide(sq.sqrt() / grad_scale, max_norm, finite)
        if not ok:
            return total_f, False
        self._sync_hypers()
        # unscaling by grad_scale / coef is unscaling by grad_scale and clipping by coef in one factor
        self.inner.clip_and_step(0.0, grad_scale=grad_scale / coef_f)
        self._gather_params()
        return total_f, True

    def _sync_hypers(self) -> None:
        for j, i in enumerate(self.inner_to_full):
            self.inner.param_groups[j].update(_hypers(self.param_groups[i]))

    def _gather_params(self) -> None:
        """Every owner broadcasts its updated parameters (per dtype, one flat buffer); the others copy them in."""
        if self.world_size == 1:
            return
        self.inner.synchronize()  # an offloaded update must be in the weights before they are sent
        pending = []
        for r, by_dtype in enumerate(self._by_owner):
            for dtype, ps in by_dtype.items():
                if r == self.rank:
                    flat = torch.cat([p.detach().reshape(-1) for p in ps])
                else:
                    flat = torch.empty(sum(p.numel() for p in ps), dtype=dtype, device=ps[0].device)
                src = tdist.get_global_rank(self.group, r) if self.group is not None else r
                pending.append((r, ps, flat, tdist.broadcast(flat, src=src, group=self.group, async_op=True)))
        for r, ps, flat, work in pending:
            work.wait()
            if r != self.rank:
                for p, chunk in zip(ps, flat.split([p.numel() for p in ps]), strict=True):
                    p.detach().copy_(chunk.view_as(p))

    # ---------------------------------------------------------------- state
    def _named_inner_state(self) -> tuple[str, dict, dict[str, Any]]:
        """(style, the inner state dict's other top-level keys, {name: per-parameter state}) of this rank."""
        sd = self.inner.state_dict()
        owned_names = [[n for n in self.group_names[i] if self.owner[n] == self.rank] for i in self.inner_to_full]
        named_style = any(isinstance(x, str) for g in sd["param_groups"] for x in g["params"])
        if named_style:  # already keyed by name (the hybrid optimizer)
            per_param = dict(sd["state"])
        else:  # torch: positions within the inner groups' params lists
            per_param = {}
            for g, names in zip(sd["param_groups"], owned_names, strict=True):
                for idx, name in zip(g["params"], names, strict=True):
                    if idx in sd["state"]:
                        per_param[name] = sd["state"][idx]
        meta = {k: v for k, v in sd.items() if k not in ("state", "param_groups")}
        return ("named" if named_style else "torch"), meta, per_param

    def state_dict(self) -> dict:
        """On rank 0: the whole optimizer's state, in the inner optimizer's own format over every parameter; on other
        ranks {} (every rank must call it: it gathers)."""
        style, meta, per_param = self._named_inner_state()
        per_param = _to_cpu(per_param)
        if self.world_size > 1:
            shards = [None] * self.world_size if self.rank == 0 else None
            tdist.gather_object(per_param, shards, dst=tdist.get_global_rank(self.group, 0) if self.group else 0,
                                group=self.group)  # fmt: skip
            if self.rank != 0:
                return {}
            per_param = {k: v for shard in shards for k, v in shard.items()}
        groups = [_hypers(g) for g in self.param_groups]
        if style == "named":
            return {
                **meta,
                "state": {n: per_param[n] for n in self.names if n in per_param},
                "param_groups": [{**h, "params": list(ns)} for h, ns in zip(groups, self.group_names, strict=True)],
            }
        index = {n: i for i, n in enumerate(self.names)}
        return {"state": {index[n]: per_param[n] for n in self.names if n in per_param},
                "param_groups": [{**h, "params": [index[n] for n in ns], "param_names": list(ns)}
                                 for h, ns in zip(groups, self.group_names, strict=True)]}  # fmt: skip

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a whole-optimizer state dict (from any number of ranks, sharded or not): each rank takes its shard."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(groups)} param groups, this optimizer {len(self.param_groups)}")
        by_name: dict[str, Any] = {}
        for g, names in zip(groups, self.group_names, strict=True):
            saved = g.get("param_names") or [x if isinstance(x, str) else names[k] for k, x in enumerate(g["params"])]
            if list(saved) != names:
                raise ValueError(f"optimizer state names parameters {list(saved)[:3]}..., this model {names[:3]}...")
            for key, name in zip(g["params"], names, strict=True):
                if key in state_dict["state"]:
                    by_name[name] = state_dict["state"][key]
        for mine, g in zip(self.param_groups, groups, strict=True):
            mine.update(_hypers(g))
        style, meta, _ = self._named_inner_state()
        owned = [[n for n in self.group_names[i] if self.owner[n] == self.rank] for i in self.inner_to_full]
        hypers = [_hypers(self.param_groups[i]) for i in self.inner_to_full]
        if style == "named":
            inner = {
                **meta,
                "state": {n: by_name[n] for ns in owned for n in ns if n in by_name},
                "param_groups": [{**h, "params": ns} for h, ns in zip(hypers, owned, strict=True)],
            }
        else:
            flat = [n for ns in owned for n in ns]
            index = {n: i for i, n in enumerate(flat)}
            inner = {"state": {index[n]: by_name[n] for n in flat if n in by_name},
                     "param_groups": [{**h, "params": [index[n] for n in ns], "param_names": ns}
                                      for h, ns in zip(hypers, owned, strict=True)]}  # fmt: skip
        self.inner.load_state_dict(inner)
