"""The GPU-stepped part with the precision-aware optimizer's states (optimizer.exp_avg_dtype, exp_avg_sq_dtype,
store_param_remainders): AdamW with exp_avg/exp_avg_sq held in bf16 or fp16 and/or the fp32 master held as the
bf16 weight plus an int16 remainder (remainder.py), on whatever device the parameters live.

On CUDA with Triton the step is one pass per parameter (narrow_kernel.py: torch's fused AdamW arithmetic, found
matching on the device at first use), reading and writing each stored byte once. Elsewhere, or where no known
arithmetic matches, the staged step below.

Staged arithmetic: the fp32 GPU part's own (gpu_side.GpuPart), on fp32 copies of a slice of the states: torch's fused
AdamW on CUDA, its single-tensor AdamW elsewhere (op for op adam_math.adamw_torch_, the CPU side's pass). Per
staging slice the gradient is widened and unscaled/clipped by the same two fp32 multiplies, narrow moments widened
(exact), the remainder master joined (exact); after the step the moments are rounded to nearest even into their
dtype (torch's conversion, as the CPU side rounds) and the master split again: the bf16 weight is its high half
rounded to nearest, ties away from zero, the CPU side's weight rounding. So the remainder form is bit for bit the
fp32 master of the fp32 GPU part on the same device. torch's fused AdamW takes one dtype for params and states
(`torch._fused_adamw_` refuses bf16 exp_avg beside an fp32 param: "expected scalar type Float but found
BFloat16"), hence the fp32 slices.

GPU bytes (`narrow_gpu_bytes`, the memory plan's figures): per parameter the moments' widths, plus the master (4 B
for half weights, 2 B as a remainder, none for fp32 weights, which are their own masters). At the step only, the
fp32 staging of STAGING_ELEMS elements at most (gradient, widened narrow moments, joined master) for the staged step:
allocated at the step's start and returned to the caching allocator at its end, so forward and backward can reuse
it; the plan counts it (the one-pass step holds none), since it cannot know the device's Triton.
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw

from engine.optim import blockwise, narrow_kernel, remainder
from engine.optim.adam_math import Hyper
from engine.optim.narrow_kernel import FP32_MASTER, HALF_MASTER, REMAINDER, Math

STAGING_ELEMS = 1 << 24  # fp32 elements per staging buffer: 64 MiB each, ~100 slices for a 1.6 B GPU part
_FP32 = torch.float32
# the moments' storage dtypes built here; blockwise.CODES: block-wise 8-bit codes with per-block maxima (blockwise.py)
NARROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16, blockwise.CODES)


def narrow_gpu_bytes(numel: int, *, half_weights: bool, moment_bytes: tuple[int, int], remainders: bool,
                     coded: tuple[bool, bool] = (False, False), blocks: int = 0) -> dict[str, int]:  # fmt: skip
    """GPU bytes of a narrow-state GPU part over `numel` parameters: master_weights and optimizer_states (held),
    optimizer_step_staging (during the step). remainders: bf16 weights with the remainder master. coded: the
    moments held as block-wise 8-bit codes (moment_bytes 1), blocks: the parameters' blockwise.blocks summed
    (one fp32 maximum each per coded moment)."""
    master = (remainder.REMAINDER_BYTES if remainders else 4) * numel if half_weights else 0
    staged = 1 + (moment_bytes[0] != 4) + (moment_bytes[1] != 4) + (remainders and half_weights)
    scales = blockwise.SCALE_BYTES * blocks * sum(coded)
    return {"master_weights": master, "optimizer_states": sum(moment_bytes) * numel + scales,
            "optimizer_step_staging": 4 * staged * min(STAGING_ELEMS, numel)}  # fmt: skip


def narrow_step_bytes(*, moment_bytes: tuple[int, int], remainders: bool, half_weights: bool, grad_bytes: int) -> int:
    """Device-memory bytes one parameter's narrow-state step reads and writes (the step's time is bound by them):
    the one-pass step's (narrow_kernel.one_pass_bytes), what runs on CUDA; 8-bit codes step staged."""
    if 1 in moment_bytes:
        return staged_step_bytes(moment_bytes=moment_bytes, remainders=remainders, half_weights=half_weights,
                                 grad_bytes=grad_bytes)  # fmt: skip
    master = (REMAINDER if remainders else HALF_MASTER) if half_weights else FP32_MASTER
    return narrow_kernel.one_pass_bytes(moment_bytes=moment_bytes, master=master, grad_bytes=grad_bytes)


def staged_step_bytes(*, moment_bytes: tuple[int, int], remainders: bool, half_weights: bool, grad_bytes: int) -> int:
    """The staged step's bytes per parameter: the fused fp32 AdamW on the slice (28), the gradient widened, each
    narrow moment widened and rounded back (a block-wise 8-bit one, 1 B: dequantised and requantised,
    blockwise.TORCH_STEP_BYTES), and the master: joined and split again in int32 ops (52), or the half weight
    written from the fp32 master."""
    moved = 28 + grad_bytes + 4
    moved += sum(blockwise.TORCH_STEP_BYTES if b == 1 else 2 * b + 8 for b in moment_bytes if b != 4)
    if half_weights:
        moved += 52 if remainders else 6
    return moved


class NarrowGpuPart:
    """AdamW over the GPU-stepped parameters with narrow states; its states are its own tensors (flat, by name)."""

    def __init__(self, entries: list[tuple[str, torch.nn.Parameter, int]], *,
                 moment_dtypes: tuple[torch.dtype, torch.dtype], remainders: bool,
                 math: Math | None | str = "auto") -> None:  # fmt: skip
        """math: the one-pass kernel's arithmetic; "auto": the one matching torch's fused AdamW on the parameters'
        device (narrow_kernel.device_math), None: the staged step."""
        self.params = {n: p for n, p, _ in entries}
        self.group_of = {n: gi for n, _, gi in entries}
        self.moment_dtypes = moment_dtypes
        self.rem: dict[str, torch.Tensor] = {}  # the remainder form's int16 masters (bf16 weights)
        self.master: dict[str, torch.Tensor] = {}  # fp32 masters: a copy for half weights, fp32 weights themselves
        for n, p in self.params.items():
            if not p.is_contiguous():
                raise ValueError(f"parameter {n!r} is not contiguous; the narrow-state step reads it as flat")
            if p.dtype == _FP32:
                self.master[n] = p.detach().view(-1)
            elif remainders and p.dtype == torch.bfloat16:
                self.rem[n] = torch.zeros(p.numel(), dtype=torch.int16, device=p.device)  # master = weight, exactly
            elif remainders:
                raise ValueError(f"store_param_remainders (optimizer.store_param_remainders) keeps the fp32 master as "
                                 f"the bf16 weight plus a remainder; {n!r} is {p.dtype}: use bf16 weights or "
                                 "store_param_remainders=False")  # fmt: skip
            else:
                self.master[n] = p.detach().float().reshape(-1).clone()
        self.m = {n: torch.zeros(p.numel(), dtype=moment_dtypes[0], device=p.device) for n, p in self.params.items()}
        self.v = {n: torch.zeros(p.numel(), dtype=moment_dtypes[1], device=p.device) for n, p in self.params.items()}
        # a coded moment's per-block maxima (zero: every code reads as zero)
        self.coded = tuple(d == blockwise.CODES for d in moment_dtypes)
        self.scales = [{n: torch.zeros(blockwise.blocks(p.numel()), device=p.device) for n, p in self.params.items()}
                       if c else {} for c in self.coded]  # fmt: skip
        self.steps = dict.fromkeys(self.params, 0)
        self.staging_bytes = 0  # of the last step's staging buffers
        if math == "auto":
            math = narrow_kernel.device_math(next(iter(self.params.values())).device) if self.params else None
        self.math: Math | None = None if any(self.coded) else math  # 8-bit codes: the staged step

    @property
    def sets_weights(self) -> frozenset[str]:
        """Names whose weights `load` sets itself (the remainder form's high halves, not the master rounded)."""
        return frozenset(self.rem)

    def held_bytes(self) -> dict[str, int]:
        """The tensors held between steps, by the memory plan's parts."""
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        masters = [t for n, t in self.master.items() if t.dtype != self.params[n].dtype]
        scales = [t for by_name in self.scales for t in by_name.values()]
        return {"master_weights": size(masters) + size(self.rem.values()),
                "optimizer_states": size(self.m.values()) + size(self.v.values()) + size(scales)}  # fmt: skip

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor], hypers: list[Hyper], inv_scale: float, coef: float) -> None:
        """grads: name -> final gradient (the parameter's shape) for the parameters that have one."""
        names = [n for n in grads if n in self.params]
        if not names:
            return
        if self.math is not None:
            self._step_one_pass(names, grads, hypers, (inv_scale, coef))
            return
        dev = self.params[names[0]].device
        total = sum(self.params[n].numel() for n in names)
        size = min(STAGING_ELEMS, total)
        narrow_m, narrow_v = (d != _FP32 for d in self.moment_dtypes)
        staging = {"g": torch.empty(size, dtype=_FP32, device=dev)}
        for key, on in (("m", narrow_m), ("v", narrow_v), ("p", any(n in self.rem for n in names))):
            if on:
                staging[key] = torch.empty(size, dtype=_FP32, device=dev)
        self.staging_bytes = 4 * size * len(staging)
        pieces: list[tuple[str, int, int, int]] = []  # (name, start, end, offset in staging)
        used = 0
        for n in sorted(names, key=lambda n: self.group_of[n]):  # a slice steps one group's hyperparameters
            if pieces and self.group_of[pieces[-1][0]] != self.group_of[n]:
                self._step_slice(pieces, grads, staging, hypers[self.group_of[pieces[0][0]]], (inv_scale, coef))
                pieces, used = [], 0
            numel, a = self.params[n].numel(), 0
            while a < numel:
                k = min(numel - a, size - used)
                if any(self.coded) and a + k < numel:  # a coded moment's slice ends on a block boundary
                    k -= k % blockwise.BLOCK
                    if k == 0:  # this slice is full to the block: step it (size >= BLOCK here)
                        self._step_slice(pieces, grads, staging, hypers[self.group_of[n]], (inv_scale, coef))
                        pieces, used = [], 0
                        continue
                pieces.append((n, a, a + k, used))
                used, a = used + k, a + k
                if used == size:
                    self._step_slice(pieces, grads, staging, hypers[self.group_of[n]], (inv_scale, coef))
                    pieces, used = [], 0
        if pieces:
            self._step_slice(pieces, grads, staging, hypers[self.group_of[pieces[0][0]]], (inv_scale, coef))
        for n in names:
            self.steps[n] += 1

    def _step_one_pass(self, names: list[str], grads: dict[str, torch.Tensor], hypers: list[Hyper],
                       factors: tuple[float, float]) -> None:  # fmt: skip
        """Each parameter in one kernel pass (its states read and written once); scalars per group and count."""
        scalars: dict[tuple[int, int], torch.Tensor] = {}
        self.staging_bytes = 0
        for n in names:
            gi, count = self.group_of[n], self.steps[n] + 1
            w = self.params[n].detach().view(-1)
            if (gi, count) not in scalars:
                scalars[gi, count] = narrow_kernel.scalars(hypers[gi], count, self.math, w.device)
            master = self.master.get(n)
            if w.numel():  # an empty grid does not launch
                narrow_kernel.launch(weight=w, master=None if master is None or master.dtype == w.dtype else master,
                                     rem=self.rem.get(n), grad=grads[n].reshape(-1), m=self.m[n], v=self.v[n],
                                     scalars_=scalars[gi, count], decay=hypers[gi].weight_decay != 0,
                                     inv_scale=factors[0], coef=factors[1], math=self.math)  # fmt: skip
            self.steps[n] = count

    def _step_slice(self, pieces: list[tuple[str, int, int, int]], given: dict[str, torch.Tensor],
                    staging: dict[str, torch.Tensor], h: Hyper, factors: tuple[float, float]) -> None:  # fmt: skip
        """One staging slice: (name, start, end, offset) pieces of parameters of one group, hyperparameters h;
        factors: (inv_scale, clip coefficient)."""
        grads, ps, ms, vs, steps = [], [], [], [], []
        fused = staging["g"].is_cuda
        for n, a, b, o in pieces:
            w = self.params[n].detach().view(-1)[a:b]
            g = staging["g"][o : o + b - a]
            g.copy_(given[n].reshape(-1)[a:b])
            grads.append(g)
            ps.append(remainder.join_into(staging["p"][o : o + b - a], w, self.rem[n][a:b]) if n in self.rem
                      else self.master[n][a:b])  # fmt: skip
            for states, key, out, scales, signed in ((self.m, "m", ms, self.scales[0], True),
                                                     (self.v, "v", vs, self.scales[1], False)):  # fmt: skip
                s = states[n][a:b]
                if scales:  # block-wise 8-bit codes: their values
                    s = blockwise.dequantise(s, scales[n][blockwise.block_slice(a, b)], signed)
                out.append(staging[key][o : o + b - a].copy_(s) if key in staging else s)
            # the count before this step: the optimizer adds one, as torch.optim's state["step"] (on the device
            # for the fused kernel, on the host for the single-tensor one)
            steps.append(torch.full((), float(self.steps[n]), dtype=_FP32, device=w.device if fused else "cpu"))
        for factor in factors:  # inv_scale, then the clip coefficient: the fp32 GPU part's two multiplies
            if factor != 1.0:
                torch._foreach_mul_(grads, factor)
        adamw(ps, grads, ms, vs, [], steps, foreach=False, fused=True if fused else None, amsgrad=False,
              beta1=h.beta1, beta2=h.beta2, lr=h.lr, weight_decay=h.weight_decay, eps=h.eps,
              maximize=False)  # fmt: skip
        for (n, a, b, _), p, m, v in zip(pieces, ps, ms, vs, strict=True):
            for states, key, x, scales, signed in ((self.m, "m", m, self.scales[0], True),
                                                   (self.v, "v", v, self.scales[1], False)):  # fmt: skip
                if scales:  # requantised per block: the nearest code
                    codes, absmax = blockwise.quantise(x, signed)
                    states[n][a:b].copy_(codes)
                    scales[n][blockwise.block_slice(a, b)].copy_(absmax)
                elif key in staging:
                    states[n][a:b].copy_(x)  # rounded to nearest even
            w = self.params[n].detach().view(-1)[a:b]
            if n in self.rem:
                remainder.split_from(p, w, self.rem[n][a:b])
            elif p.dtype != w.dtype:
                w.copy_(p)  # half weights from the fp32 master, as the fp32 GPU part refreshes them

    def export(self, name: str) -> dict:
        """step, the fp32 master, and the moments in their dtype: host tensors of the parameter's shape."""
        p = self.params[name]
        if name in self.rem:
            master = remainder.join(p.detach().reshape(-1).cpu(), self.rem[name].cpu())
        else:
            master = self.master[name].detach().float().cpu().clone()
        st = {"step": self.steps[name], "master": master.view(p.shape),
              "exp_avg": self.m[name].cpu().clone().view(p.shape),
              "exp_avg_sq": self.v[name].cpu().clone().view(p.shape)}  # fmt: skip
        for key, scales in zip(blockwise.MOMENTS, self.scales, strict=True):
            if scales:  # saved in its form: the codes and their blocks' maxima
                st[blockwise.absmax_key(key)] = scales[name].cpu().clone()
        return st

    @torch.no_grad()
    def load(self, name: str, st: dict) -> None:
        """One parameter's state saved in any dtypes (moments widened or rounded to nearest); with the remainder
        form its weight too (the master's high half, see sets_weights)."""
        p = self.params[name]
        self.steps[name] = int(st["step"])
        master = st["master"].reshape(-1).float()
        if name in self.rem:
            weight, rem = remainder.split(master)
            self.rem[name].copy_(rem)
            p.view(-1).copy_(weight)
        else:
            self.master[name].copy_(master)
        for states, key, scales in ((self.m, "exp_avg", self.scales[0]), (self.v, "exp_avg_sq", self.scales[1])):
            # any saved form (codes dequantised or kept, values rounded or quantised); none (SGD's): zero
            blockwise.load_moment(st, key, states[name], scales[name] if scales else None)
