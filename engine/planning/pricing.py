"""A plan's predicted step time: engine.planning.step_time's formulas fed from one census and its settings.

The workload (FLOPs of one micro-batch's forward, layer by layer) is read once from the census: a layer's matmuls
are 2 x its parameters per token, the output side's 2 x its parameters per token (embedding lookups are not
matmuls), and for the built-in GPT (and megatron-core's) the attention scores 4 x seq x hidden per token and
layer (the full s x s, Megatron's and PaLM's convention). A user's model has no stated shape: its attention
scores are not counted (the plan says so). Tokens per micro-batch: the example batch's, else micro-batch x
model.seq_length.
"""

from __future__ import annotations

import functools

from engine.config import Config
from engine.optim.gpu_side import gpu_step_bytes
from engine.planning import rates
from engine.planning.census import Census
from engine.planning.memory import Plan, Settings
from engine.planning.step_time import Costs, Mix, Schedule, StepTime, Workload, step_time


class Pricer:
    """Prices plans of one census and settings with `costs` (None: the stated defaults for the device, with the rates
    the config gives: engine.planning.rates.stated)."""

    def __init__(self, cfg: Config, census: Census, settings: Settings, *, cuda: bool, costs: Costs | None = None,
                 tokens: int | None = None) -> None:  # fmt: skip
        self.cfg, self.census, self.settings = cfg, census, settings
        self.costs = costs or rates.stated(cfg, cuda=cuda)
        self.tokens = tokens or cfg.train.micro_batch_size * cfg.model.seq_length
        grad_bytes = 4 if settings.main_grads else settings.weight_elem
        step_bytes = gpu_step_bytes(kind=settings.kind, half_weights=settings.half, grad_bytes=grad_bytes,
                                    moment_bytes=settings.moment_bytes, remainders=settings.remainders)  # fmt: skip
        self.schedule = Schedule(cpu_offload=settings.cpu_offload, overlap=settings.overlap, delayed=settings.delayed,
                                 grad_bytes=grad_bytes, weight_bytes=settings.weight_elem,
                                 gpu_step_bytes=step_bytes)  # fmt: skip

    @functools.cached_property
    def workload(self) -> Workload:
        c, m, n = self.census, self.cfg.model, self.tokens
        attention = 4 * n * m.seq_length * m.hidden_size if c.builtin else 0
        params = [0] * c.n_layers
        for first, end, each in c.layer_pieces:  # O(depth) once; every plan after it is priced in O(1)
            for i in range(first, end):
                params[i] += each
        per_layer = [2 * x * n + attention for x in params]
        note = "" if c.builtin else "a user's model: attention scores not counted"
        return Workload.of_layers(self.settings.micro_batches, per_layer, 2 * c.side_numel["output"] * n, note)

    def mix(self, p: Plan) -> Mix:
        return Mix(fraction=p.fraction, offloaded_layers=p.offloaded_layers, recomputed_layers=p.recomputed_layers,
                   cpu_parameters=p.cpu_parameters, gpu_parameters=p.parameters - p.cpu_parameters,
                   offloaded_bytes=p.offloaded_layers * p.offloaded_layer_bytes)  # fmt: skip

    def price(self, p: Plan) -> StepTime:
        return step_time(self.workload, self.mix(p), self.schedule, self.costs)

    def least_with_layers(self, k: int, layer_bytes: int) -> float:
        """A lower bound of the step time of any plan with k offloaded layers: its compute and copies alone."""
        bare = Mix(0.0, k, 0, 0, 0, k * layer_bytes)
        return step_time(self.workload, bare, Schedule(False, False, False, 0, 0), self.costs).total_s

    def hidden_layers(self, layer_bytes: int) -> int:
        """The most layers whose copies hide entirely under one micro-batch's forward and backward compute."""
        if not layer_bytes:
            return self.census.n_layers
        c, fwd = self.costs, self.workload.forward_flops / self.costs.flops_per_s
        room = min(fwd * c.pcie_d2h_bytes_per_s, 2 * fwd * c.pcie_h2d_bytes_per_s)
        return int(room // layer_bytes)
