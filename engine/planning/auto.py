"""Choosing what the config leaves to the plan ("auto"), and the bounds a refusal names.

optimizer.optimizer_offload_fraction="auto": the smallest fraction, in steps of 0.01, whose plan fits the GPU
(margin included); then the host is checked at it (the host only grows with the fraction, so if it does not
fit there nothing does).

model.cpu_offloading_num_layers="auto": of the counts k from 0 to num_layers-1, each with its own smallest
fitting fraction when that is "auto" too, the pair that adds the least estimated time per step wins (ties:
fewer layers). The GPU's bytes fall as k or the fraction grows, so bisection finds the fewest layers that fit
at a fraction; k only matters where the smallest fitting fraction drops (between two such counts the cost
grows with k and so does the host's pool), so only those counts are evaluated: O(log num_layers) plans per
fraction step, never every k. Why a time estimate: the two mechanisms buy GPU memory at different prices.
  activation offload   each offloaded layer's saved bytes cross PCIe twice per micro-batch (out in forward,
                       back in backward): micro_batches x 2 x bytes / PCIE_BYTES_PER_S
  optimizer offload    each CPU-stepped parameter costs the CPU step once per global batch:
                       parameters / CPU_PARAMS_PER_S (its gradient and weight copies run beside backward
                       and forward and are not counted)
Per GiB of GPU memory saved, one offloaded GiB of activations costs 2 x 1.07 GB / 50 GB/s = 43 ms per
micro-batch, while one GiB of fp32 master+m+v (12 B per parameter: 89 M parameters) costs 89 M / 3.6 G/s =
25 ms per step. With several micro-batches per step the optimizer is the cheaper way to free memory, which is
why "auto" offloads layers only when the fraction alone cannot make the plan fit (or, with one micro-batch,
when a layer's activations free more per second of cost). Both figures are upper bounds of the exposed
time (overlap hides some of either); they were measured on the H200 (docs/BENCHMARKS.md: pinned copies
54-55 GB/s each way, the CPU AdamW step 3.6-4.1 G params/s on 15 threads).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import replace

from engine.config import Config
from engine.planning.census import Census
from engine.planning.memory import GIB, DevicePlan, Plan, Settings, evaluate

PCIE_BYTES_PER_S = 50e9
CPU_PARAMS_PER_S = 3.6e9
STEPS = 100  # the fraction's grid: 0.00, 0.01, ..., 1.00


class NothingFits(ValueError):
    """ "auto" found no setting that fits; the message is the one line a user reads."""


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def added_seconds(p: Plan, s: Settings) -> float:
    """The estimated time offloading adds per step (see the module docstring)."""
    pcie = s.micro_batches * 2 * p.offloaded_layers * p.offloaded_layer_bytes / PCIE_BYTES_PER_S
    return pcie + p.cpu_parameters / CPU_PARAMS_PER_S


class Planner:
    """One census and budgets; evaluates plans at any fraction and layer count, and searches them."""

    def __init__(self, cfg: Config, census: Census, settings: Settings, *, cuda: bool, gpu_budget: int | None,
                 host_budget: int | None) -> None:  # fmt: skip
        self.cfg, self.census, self.settings = cfg, census, settings
        self.cuda, self.gpu_budget, self.host_budget = cuda, gpu_budget, host_budget

    def evaluate(self, fraction: float, k: int, settings: Settings | None = None) -> Plan:
        return evaluate(self.census, settings or self.settings, fraction, k, cuda=self.cuda,
                        gpu_budget=self.gpu_budget, host_budget=self.host_budget)  # fmt: skip

    def max_layers(self) -> int:
        return max(0, self.census.n_layers - 1)  # the reference: fewer than num_layers

    # ---- bounds ---------------------------------------------------------------------------------------------
    def smallest_gpu_fraction(self, k: int, settings: Settings | None = None, *, below: int = STEPS) -> Plan | None:
        """The plan at the smallest grid fraction (at most below / STEPS) whose GPU part fits, or None."""
        # the GPU's bytes fall as the fraction grows
        step = _first(lambda i: self.evaluate(i / STEPS, k, settings).gpu.fits, 0, below)
        return None if step is None else self.evaluate(step / STEPS, k, settings)

    def largest_host_fraction(self, k: int) -> float | None:
        """The largest grid fraction whose host part fits, or None (not even at 0)."""
        # the host's bytes grow with the fraction: the first that does not fit, less one
        over = _first(lambda i: not self.evaluate(i / STEPS, k).host.fits, 0, STEPS)
        if over == 0:
            return None
        return (STEPS if over is None else over - 1) / STEPS

    def fewest_gpu_layers(self, fraction: float, settings: Settings | None = None, *, least: int = 0) -> int | None:
        """The fewest offloaded layers (at least `least`) whose GPU part fits at `fraction`, or None."""

        # the GPU's bytes fall as more layers are offloaded, from the first on: offloading one layer may add
        # more (two double-buffer slabs) than it frees, so no layers at all is tried on its own
        def fits(k: int) -> bool:
            return self.evaluate(fraction, k, settings).gpu.fits

        if least == 0 and fits(0):
            return 0
        return _first(fits, max(1, least), self.max_layers())

    def most_host_layers(self, fraction: float, below: int) -> int | None:
        """The most offloaded layers (fewer than `below`) whose host part fits at `fraction`, or None."""
        # the host's bytes grow with the offloaded layers (their pinned pool)
        over = _first(lambda k: not self.evaluate(fraction, k).host.fits, 0, below - 1)
        return below - 1 if over is None else (over - 1 if over > 0 else None)

    def least_gpu(self, fraction: float) -> Plan:
        """The plan with the least GPU memory at `fraction`: the fewest layers that reach the most layers' bytes."""
        most = self.evaluate(fraction, self.max_layers())
        none = self.evaluate(fraction, 0)
        if none.gpu.total_bytes <= most.gpu.total_bytes:
            return none
        k = _first(lambda j: self.evaluate(fraction, j).gpu.total_bytes <= most.gpu.total_bytes, 1, self.max_layers())
        return self.evaluate(fraction, k) if k is not None else most

    # ---- "auto" ---------------------------------------------------------------------------------------------
    def resolve(self, fraction: float | str, layers: int | str, *, hint: bool = True) -> Plan:
        """The plan with "auto" values chosen (see the module docstring); NothingFits if none fits (hint: its
        message names the largest depth that would fit)."""
        s = self.settings
        auto_f, auto_k = fraction == "auto", layers == "auto"
        if auto_f and self.cuda and self.gpu_budget is None:
            raise NothingFits('optimizer.optimizer_offload_fraction="auto" needs the GPU\'s memory: run on the '
                              "GPU, or pass --gpu-memory GIB to plan for one")  # fmt: skip
        best: tuple[float, int, Plan] | None = None
        nearest: Plan | None = None  # for the message: the least GPU, then the host at the fitting fraction

        def costs_more(k: int) -> bool:  # more layers only cost more PCIe time than the best found costs in all
            return best is not None and k * self._layer_seconds >= best[0]

        for k, p in self._candidates(fraction, layers, costs_more):
            if nearest is None or _closeness(p) < _closeness(nearest):
                nearest = p
            if not p.fits:
                continue
            cost = added_seconds(p, s)
            if best is None or cost < best[0] - 1e-9:
                best = (cost, k, p)
        if best is None:
            raise NothingFits(self._nothing_fits(nearest, auto_f, auto_k, hint))
        return best[2]

    def _candidates(self, fraction: float | str, layers: int | str, stop: Callable[[int], bool]
                    ) -> Iterator[tuple[int, Plan]]:  # fmt: skip
        """(k, plan) in rising k: only the counts where the smallest fitting fraction drops (see the module
        docstring: between two such counts the cost only grows and the host only fills), until stop(k)."""
        auto_f = fraction == "auto"
        if layers != "auto":
            k = int(layers)
            p = self.smallest_gpu_fraction(k) if auto_f else self.evaluate(float(fraction), k)
            yield k, p if p is not None else self.evaluate(1.0, k)
            return
        k = self.fewest_gpu_layers(1.0 if auto_f else float(fraction))
        if k is None:  # the GPU fits nowhere: the least it reaches, for the message
            least = self.least_gpu(1.0 if auto_f else float(fraction))
            yield least.offloaded_layers, least
            return
        if not auto_f:
            yield k, self.evaluate(float(fraction), k)
            return
        below = STEPS
        while not stop(k):
            p = self.smallest_gpu_fraction(k, below=below)
            assert p is not None  # k was found fitting at `below`
            yield k, p
            below = round(p.fraction * STEPS) - 1
            if below < 0:
                return
            nxt = self.fewest_gpu_layers(below / STEPS, least=k + 1)
            if nxt is None:
                return
            k = nxt

    @functools.cached_property
    def _layer_seconds(self) -> float:
        """The PCIe time one offloaded layer adds per step (a lower bound for every further layer)."""
        p = self.evaluate(0.0, 1)
        return self.settings.micro_batches * 2 * p.offloaded_layer_bytes / PCIE_BYTES_PER_S

    def _nothing_fits(self, p: Plan | None, auto_f: bool, auto_k: bool, hint: bool) -> str:
        which = " and ".join(k for k, a in (("optimizer.optimizer_offload_fraction", auto_f),
                                             ("model.cpu_offloading_num_layers", auto_k)) if a)  # fmt: skip
        head = f'no {which} fits ("auto")'
        if p is not None and not p.gpu.fits:
            why = (f"the least GPU memory it reaches is {gib(p.gpu.total_bytes)} GiB (fraction {p.fraction:.2f}, "
                   f"{p.offloaded_layers} offloaded layers), {gib(self.gpu_budget or 0)} GiB available")  # fmt: skip
        elif p is not None:
            why = (f"where the GPU fits (fraction {p.fraction:.2f}, {p.offloaded_layers} offloaded layers) the "
                   f"host needs {gib(p.host.total_bytes)} GiB, {gib(self.host_budget or 0)} GiB available")  # fmt: skip
        else:
            why = "no setting was tried"
        return f"{head}: {why}" + (f"; {self.largest_model_hint()}" if hint else "")

    def largest_model_hint(self) -> str:
        """What would fit: the built-in GPT's largest depth at this shape, by the same "auto" search."""
        m, t = self.cfg.model, self.cfg.train
        shape = f"hidden {m.hidden_size}, seq {m.seq_length}, micro-batch {t.micro_batch_size}"
        if not self.census.builtin:
            return f"use a smaller model or lower train.micro_batch_size (now {t.micro_batch_size})"
        lo, hi, found = 1, m.num_layers - 1, None
        fraction = "auto" if self.settings.cpu_offload else 0.0
        while lo <= hi:  # fitting falls with depth
            mid = (lo + hi) // 2
            census = self.census.truncated(mid, self.settings.weight_elem)
            trial = Planner(self.cfg, census, self.settings, cuda=self.cuda, gpu_budget=self.gpu_budget,
                            host_budget=self.host_budget)  # fmt: skip
            layers = "auto" if self.settings.layer_offload else 0
            try:
                found = trial.resolve(fraction, layers, hint=False)
                lo = mid + 1
            except NothingFits:
                hi = mid - 1
        if found is None:
            return f"not even one layer fits at {shape}"
        return (f"at {shape} at most {hi} layers ({found.parameters / 1e9:.1f} B parameters) fit, with fraction "
                f"{found.fraction:.2f} and {found.offloaded_layers} offloaded layers")  # fmt: skip

    def with_optimizer_offload(self) -> Settings:
        """These settings with optimizer offload switched on (for a fix to suggest when it is off)."""
        return replace(self.settings, cpu_offload=True)


def _over(d: DevicePlan) -> int:
    """Bytes over budget (a budget of 0 bytes is a budget: only None means none was checked)."""
    return 0 if d.budget_bytes is None else max(0, d.total_bytes - d.budget_bytes)


def _closeness(p: Plan) -> tuple[int, int]:
    return (_over(p.gpu), _over(p.host))


def _first(holds: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The smallest i in [lo, hi] where holds(i), for a `holds` that turns true once and stays so; None if
    it never holds. Bisection: O(log(hi - lo)) calls, which keeps planning a 100,000-layer model quick."""
    if lo > hi or not holds(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
