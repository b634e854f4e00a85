"""Choosing what the config leaves to the plan ("auto"): the fastest mix that fits, and the bounds a refusal names.

The "auto" keys: optimizer.optimizer_offload_fraction (a grid of 0.00, 0.01, ..., 1.00),
model.cpu_offloading_num_layers (0 to num_layers - 1) and model.recompute_num_layers (layers recomputed right
after the offloaded ones). Memory is the constraint and time the choice: among the mixes whose plan fits both
budgets, the one with the least predicted step time wins (engine.planning.pricing / step_time: the CPU step and
what the schedule hides of it, activation copies beyond compute, recomputed forwards); steps within 1% of the
fastest are a tie (below what the model can tell apart), won by the fewest offloaded and recomputed layers, then
the least fraction. Nothing else is ever changed: the candidates differ only in the keys written "auto", so
the numerics are the ones the config asked for.

The candidates, a number independent of the depth (each found by bisection, O(log num_layers) plans):
  layers and fraction   the GPU's bytes fall as k or the fraction grows, so bisection finds the fewest layers
                        that fit at a fraction; k only matters where the smallest fitting fraction drops (between
                        two such counts the time only grows and so does the host's pool), so only those counts
                        are walked, in rising k, until a lower bound of the time with k layers (compute and
                        copies alone) reaches the best found. A larger fraction than the smallest that fits at a
                        k is not a candidate: it adds CPU work, and where the CPU step is hidden it saves only the
                        GPU step's share of those parameters (milliseconds) for more host memory.
  recompute             at no offloaded layers and at the most whose copies hide under compute, at the fraction
                        floor, the largest fraction whose CPU step is still hidden, and the smallest that fits
                        without recompute: the fewest recomputed layers that fit (step time is linear in each
                        between those points, so its least lies at one of them).
With optimizer.delayed_param_update the fraction is at least the smallest that steps a parameter on the CPU:
fraction 0 would leave the delayed update with nothing to do, which is not what the config asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

from engine.config import Config
from engine.planning.census import Census
from engine.planning.memory import GIB, DevicePlan, Plan, Settings, evaluate
from engine.planning.pricing import Pricer
from engine.planning.step_time import Costs

STEPS = 100  # the fraction's grid: 0.00, 0.01, ..., 1.00
TIE = 0.01  # predicted steps this close (a share of the fastest) are a tie: below what the model can tell apart
KEYS = ("optimizer.optimizer_offload_fraction", "model.cpu_offloading_num_layers", "model.recompute_num_layers")


class NothingFits(ValueError):
    """ "auto" found no setting that fits; the message is the one line a user reads."""


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


class Planner:
    """One census and budgets; evaluates plans at any fraction and layer count, and searches them."""

    def __init__(self, cfg: Config, census: Census, settings: Settings, *, cuda: bool, gpu_budget: int | None,
                 host_budget: int | None, costs: Costs | None = None, tokens: int | None = None) -> None:  # fmt: skip
        self.cfg, self.census, self.settings = cfg, census, settings
        self.cuda, self.gpu_budget, self.host_budget = cuda, gpu_budget, host_budget
        self.pricer = Pricer(cfg, census, settings, cuda=cuda, costs=costs, tokens=tokens)

    def evaluate(self, fraction: float, k: int, settings: Settings | None = None, r: int | None = None) -> Plan:
        return evaluate(self.census, settings or self.settings, fraction, k, cuda=self.cuda,
                        gpu_budget=self.gpu_budget, host_budget=self.host_budget, r=r)  # fmt: skip

    def priced(self, p: Plan) -> Plan:
        """`p` with its predicted step time and the rates it was priced with."""
        c = self.pricer.costs
        return replace(p, step_time=self.pricer.price(p), costs=c.describe(), rates=c.to_json())

    def max_layers(self) -> int:
        return max(0, self.census.n_layers - 1)  # the reference: fewer than num_layers

    # ---- bounds ---------------------------------------------------------------------------------------------
    def smallest_gpu_fraction(self, k: int, settings: Settings | None = None, *, below: int = STEPS,
                              least: int = 0) -> Plan | None:  # fmt: skip
        """The plan at the smallest grid fraction (between least and below, / STEPS) whose GPU part fits, or None."""
        # the GPU's bytes fall as the fraction grows
        step = _first(lambda i: self.evaluate(i / STEPS, k, settings).gpu.fits, least, below)
        return None if step is None else self.evaluate(step / STEPS, k, settings)

    def fraction_floor(self) -> int:
        """The least grid step "auto" may choose: 0, or with the delayed update the first that steps a parameter
        on the CPU (NothingFits when none does)."""
        if not self.settings.delayed:
            return 0
        step = _first(lambda i: self.evaluate(i / STEPS, 0).cpu_parameters > 0, 1, STEPS)
        if step is None:
            raise NothingFits('optimizer.optimizer_offload_fraction="auto" with optimizer.delayed_param_update: '
                              "no fraction steps a parameter on the CPU; set "
                              "optimizer.delayed_param_update=false")  # fmt: skip
        return step

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
    def resolve(self, fraction: float | str, layers: int | str, recompute: int | str | None = None, *,
                hint: bool = True) -> Plan:  # fmt: skip
        """The fastest fitting plan, "auto" values chosen (see the module docstring), priced, with its two
        runners-up; NothingFits if none fits (hint: its message names the largest depth that would fit)."""
        auto = dict(zip(KEYS, (fraction == "auto", layers == "auto", recompute == "auto" and self.settings.recompute),
                        strict=True))  # fmt: skip
        if auto[KEYS[0]] and self.cuda and self.gpu_budget is None:
            raise NothingFits('optimizer.optimizer_offload_fraction="auto" needs the GPU\'s memory: run on the '
                              "GPU, or pass --gpu-memory GIB to plan for one")  # fmt: skip
        floor = self.fraction_floor() if auto[KEYS[0]] else 0
        ranked: dict[tuple[float, int, int], tuple[float, int, Plan]] = {}
        nearest: Plan | None = None  # for the message: the least GPU, then the host at the fitting fraction
        layer_bytes = self.evaluate(0.0, 1).offloaded_layer_bytes

        def slower(k: int) -> bool:  # k layers' compute and copies alone already take the best time found
            return bool(ranked) and self.pricer.least_with_layers(k, layer_bytes) >= min(v[0] for v in ranked.values())

        candidates = self._candidates(fraction, layers, slower, floor)
        if auto[KEYS[2]]:
            hidden = self.pricer.hidden_layers(layer_bytes)
            candidates = _chain(candidates, self._recomputing(fraction, layers, floor, hidden))
        for p in candidates:
            if nearest is None or _closeness(p) < _closeness(nearest):
                nearest = p
            if p.fits:
                key = (p.fraction, p.offloaded_layers, p.recomputed_layers)
                ranked[key] = (self.pricer.price(p).total_s, p.offloaded_layers + p.recomputed_layers, p)
        if not ranked:
            raise NothingFits(self._nothing_fits(nearest, auto, hint))
        chosen, runners = _choose(list(ranked.values()))
        if len(runners) < 2:  # fewer were weighed: the chosen mix's neighbours, for the reader to compare
            runners += sorted(self._neighbours(chosen, auto, ranked), key=lambda p: self.pricer.price(p).total_s)
        return replace(
            self.priced(chosen),
            next_best=tuple(
                (p.fraction, p.offloaded_layers, p.recomputed_layers, self.pricer.price(p)) for p in runners[:2]
            ),
        )

    def _neighbours(self, p: Plan, auto: dict[str, bool], seen: dict) -> list[Plan]:
        """Fitting plans one grid step from `p` in each "auto" key it can grow (one fraction step, one more
        offloaded or recomputed layer): never faster where the search is right, shown beside its choice."""
        f, k, r = round(p.fraction * STEPS), p.offloaded_layers, p.recomputed_layers
        steps = [(f + 1, k, r)] if auto[KEYS[0]] and f < STEPS else []
        steps += [(f, k + 1, r)] if auto[KEYS[1]] and k < self.max_layers() else []
        steps += [(f, k, r + 1)] if auto[KEYS[2]] and k + r < self.census.n_layers else []
        near = [self.evaluate(i / STEPS, j, r=q) for i, j, q in steps]
        return [q for q in near if q.fits and (q.fraction, q.offloaded_layers, q.recomputed_layers) not in seen]

    def _candidates(self, fraction: float | str, layers: int | str, stop: Callable[[int], bool], floor: int = 0
                    ) -> Iterator[Plan]:  # fmt: skip
        """Plans in rising k: only the counts where the smallest fitting fraction drops (see the module
        docstring: between two such counts the time only grows and the host only fills), until stop(k)."""
        auto_f = fraction == "auto"
        if layers != "auto":
            k = int(layers)
            p = self.smallest_gpu_fraction(k, least=floor) if auto_f else self.evaluate(float(fraction), k)
            yield p if p is not None else self.evaluate(1.0, k)
            return
        k = self.fewest_gpu_layers(1.0 if auto_f else float(fraction))
        if k is None:  # the GPU fits nowhere: the least it reaches, for the message
            yield self.least_gpu(1.0 if auto_f else float(fraction))
            return
        if not auto_f:
            yield self.evaluate(float(fraction), k)
            return
        below = STEPS
        while not stop(k):
            p = self.smallest_gpu_fraction(k, below=below, least=floor)
            if p is None:  # fits only below the floor
                return
            yield p
            below = round(p.fraction * STEPS) - 1
            if below < floor:
                return
            nxt = self.fewest_gpu_layers(below / STEPS, least=k + 1)
            if nxt is None:
                return
            k = nxt

    def _recomputing(self, fraction: float | str, layers: int | str, floor: int, hidden: int) -> Iterator[Plan]:
        """The recompute candidates (see the module docstring): the fewest recomputed layers that fit at a few
        (fraction, offloaded layers), each found by bisection."""
        if layers != "auto":
            ks = [int(layers)]
        else:
            ks = sorted({0, min(hidden, self.max_layers())}) if self.settings.layer_offload else [0]
        for k in ks:
            if fraction != "auto":
                steps = [float(fraction)]
            else:
                alone = self.smallest_gpu_fraction(k, least=floor)
                top = round(alone.fraction * STEPS) if alone is not None else STEPS
                picks = {floor, self._largest_hidden_step(k, floor, top), top}
                # where the host binds below `top`, recompute may fit only between: its largest fraction too
                host = self.largest_host_fraction(k)
                if host is not None and floor <= round(host * STEPS) < top:
                    picks.add(round(host * STEPS))
                steps = [i / STEPS for i in sorted(picks)]
            for f in steps:
                yield self._fewest_recomputed(f, k)

    def _largest_hidden_step(self, k: int, floor: int, top: int) -> int:
        """The largest grid step (floor..top) at which the CPU step is still entirely hidden (floor if none)."""
        shows = _first(lambda i: self.pricer.price(self.evaluate(i / STEPS, k, r=0)).cpu_exposed_s > 0, floor, top)
        return top if shows is None else max(floor, shows - 1)

    def _fewest_recomputed(self, fraction: float, k: int) -> Plan:
        """The plan with the fewest recomputed layers whose GPU part fits (the most, when none fits)."""
        most = max(0, self.census.n_layers - k)

        def fits(r: int) -> bool:
            return self.evaluate(fraction, k, r=r).gpu.fits

        # recomputing one layer adds its rebuilt activations to backward, so none at all is tried on its own
        r = 0 if fits(0) else _first(fits, 1, most)
        return self.evaluate(fraction, k, r=most if r is None else r)

    def _nothing_fits(self, p: Plan | None, auto: dict[str, bool], hint: bool) -> str:
        which = " and ".join(k for k, a in auto.items() if a)
        head = f'no {which} fits ("auto")'
        at = "" if p is None else f"fraction {p.fraction:.2f}, {p.offloaded_layers} offloaded layers"
        at += f", {p.recomputed_layers} recomputed" if p is not None and p.recomputed_layers else ""
        if p is not None and not p.gpu.fits:
            why = (f"the least GPU memory it reaches is {gib(p.gpu.total_bytes)} GiB ({at}), "
                   f"{gib(self.gpu_budget or 0)} GiB available")  # fmt: skip
        elif p is not None:
            why = (f"where the GPU fits ({at}) the host needs {gib(p.host.total_bytes)} GiB, "
                   f"{gib(self.host_budget or 0)} GiB available")  # fmt: skip
        else:
            why = "no setting was tried"
        return f"{head}: {why}" + (f"; {self.largest_model_hint()}" if hint else "")

    def largest_model_hint(self) -> str:
        """What would fit: the built-in GPT's largest depth at this shape, by the same "auto" search."""
        m, t = self.cfg.model, self.cfg.train
        shape = f"hidden {m.hidden_size}, seq {m.seq_length}, micro-batch {t.micro_batch_size}"
        if not self.census.builtin:
            fix = f"use a smaller model or lower train.micro_batch_size (now {t.micro_batch_size})"
            if not self.settings.recompute:  # recomputing frees what the host and the GPU would hold
                fix += ', or let the plan recompute layers: model.recompute_granularity="full" and '
                fix += 'model.recompute_num_layers="auto"'
            return fix
        lo, hi, found = 1, m.num_layers - 1, None
        fraction = "auto" if self.settings.cpu_offload else 0.0
        while lo <= hi:  # fitting falls with depth
            mid = (lo + hi) // 2
            census = self.census.truncated(mid, self.settings.weight_elem)
            trial = Planner(self.cfg, census, self.settings, cuda=self.cuda, gpu_budget=self.gpu_budget,
                            host_budget=self.host_budget, costs=self.pricer.costs,
                            tokens=self.pricer.tokens)  # fmt: skip
            layers = "auto" if self.settings.layer_offload else 0
            try:
                found = trial.resolve(fraction, layers, self.settings.recompute_num_layers, hint=False)
                lo = mid + 1
            except NothingFits:
                hi = mid - 1
        if found is None:
            return f"not even one layer fits at {shape}"
        recomputed = f", {found.recomputed_layers} recomputed" if found.recomputed_layers else ""
        return (f"at {shape} at most {hi} layers ({found.parameters / 1e9:.1f} B parameters) fit, with fraction "
                f"{found.fraction:.2f} and {found.offloaded_layers} offloaded layers{recomputed}")  # fmt: skip

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


def _chain(*its: Iterator[Plan]) -> Iterator[Plan]:
    for it in its:
        yield from it


def _choose(priced: list[tuple[float, int, Plan]]) -> tuple[Plan, list[Plan]]:
    """(the choice, the others fastest first) of (time, offloaded + recomputed layers, plan): among the plans
    within TIE of the fastest, the one with the fewest layers offloaded or recomputed, then the least fraction."""
    fastest = min(t for t, _, _ in priced)
    chosen = min((x for x in priced if x[0] <= fastest * (1 + TIE)), key=lambda x: (x[1], x[2].fraction, x[0]))
    rest = sorted((x for x in priced if x is not chosen), key=lambda x: (x[0], x[1], x[2].fraction))
    return chosen[2], [p for _, _, p in rest]
