"""The predicted time of one training step for a mix of offloading settings: what "auto" minimises.

A mix is (optimizer offload fraction, offloaded layers k, recomputed layers r; the recomputed ones are disjoint
from the offloaded ones). Its time is priced from a `Workload` (what one step computes, the same for every mix)
and `Costs` (rates of this machine, or the stated defaults below), per micro-batch and per step:

  forward     max(F / flops + h D / pcie_d2h,      F: the forward's FLOPs of one micro-batch; D: the bytes the
                  D / pcie_d2h)                    k offloaded layers move to the host (each way), copied on
                                                   a side stream under the forward (and reloaded under the
                                                   backward). Where the link binds, the activation bench
                                                   measured the copies within 1.01-1.08x of D / pcie
                                                   (docs/BENCHMARKS.md, "Activation offloading"); where
                                                   compute covers them they still show a share h of their
                                                   copy time (Costs.copy_share_under_compute)
  backward    max((2F + R) / flops + h D / pcie_h2d,
                  D / pcie_h2d)                    R: the forward FLOPs of the r recomputed layers (full
                                                   recompute runs each one's forward again in its backward)
  GPU step    n_gpu x gpu_step_bytes / hbm         the GPU side's AdamW is bound by device memory
  CPU step    n_cpu / cpu_params                   the host's AdamW over the CPU-stepped parameters; the part
                                                   the schedule cannot hide is added:
                overlap off   all of it, plus the gradients' and weights' copies over PCIe
                exact         what is left after the window it runs in: the GPU step and the next forward's
                              first micro-batch through the layers that are not CPU-stepped (the CPU-stepped
                              ones are the output end; they are awaited layer by layer); measured on the H200,
                              the GPU waited 475-594 ms of a 582-706 ms step at 8 B (docs/BENCHMARKS.md)
                delayed       what is left after the whole next step's GPU work (the update lands one step
                              late: optimizer.delayed_param_update)
  step        micro_batches x (forward + backward) + GPU step + the CPU step's exposed part

Where the rates come from is explicit: `default_costs` states them in one place (each with its source), the
config's plan section gives any of them, engine.planning.rates measures the others on the machine that trains, and
`Costs.describe` says which is which in the plan's text ("rates: PCIe 53.1/54.8 GB/s measured, ..."). The same
formulas run on a CPU device (the tests), with its own stated rates.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.optim.gpu_side import FP32_STEP_BYTES

GB = 1e9

# Bytes one parameter's GPU-side AdamW reads and writes with fp32 states: the fp32 master, m and v read and
# written (24), the gradient read (2-4) and the half weight written (2); narrow states: Schedule.gpu_step_bytes.
GPU_STEP_BYTES = FP32_STEP_BYTES


RATES = {  # Costs' rate fields -> the key that gives each (the plan section of the config)
    "pcie_d2h_bytes_per_s": "plan.pcie_d2h_gb_per_s",
    "pcie_h2d_bytes_per_s": "plan.pcie_h2d_gb_per_s",
    "cpu_params_per_s": "plan.cpu_adam_g_params_per_s",
    "flops_per_s": "plan.gpu_tflops",
}


@dataclass(frozen=True)
class Costs:
    """The rates a mix is priced with (bytes, FLOPs and parameters per second), and where each comes from: measured
    on this machine (engine.planning.rates), given by the config (the plan section), else stated (`source`)."""

    pcie_d2h_bytes_per_s: float  # device to host, pinned
    pcie_h2d_bytes_per_s: float  # host to device, pinned
    cpu_params_per_s: float  # the CPU AdamW step over the CPU-stepped part
    flops_per_s: float  # the model's matmuls, achieved (not the datasheet's peak)
    hbm_bytes_per_s: float  # the GPU side's optimizer step
    source: str  # where the stated figures come from, for the plan's text
    # the share of an activation copy's time that shows though compute covers it (hooks, the copy engine's and
    # host memory's contention); 0 prices a covered copy as free
    copy_share_under_compute: float = 0.0
    measured: frozenset[str] = frozenset()  # the fields measured on this machine
    given: frozenset[str] = frozenset()  # the fields the config gave

    def origin(self, name: str) -> str:
        """ "measured", "given" or "stated": where rate field `name` comes from."""
        return "measured" if name in self.measured else "given" if name in self.given else "stated"

    def describe(self) -> str:
        """One line: each rate and where it comes from, e.g. "rates: PCIe 53.1/54.8 GB/s measured, CPU AdamW 4.4 G
        params/s measured, GPU 612 TFLOP/s measured"; the stated ones' source after them."""
        o = self.origin
        d2h, h2d = o("pcie_d2h_bytes_per_s"), o("pcie_h2d_bytes_per_s")
        pcie = d2h if d2h == h2d else f"{d2h}/{h2d}"
        tflops = self.flops_per_s / 1e12
        parts = [f"PCIe {self.pcie_d2h_bytes_per_s / GB:.1f}/{self.pcie_h2d_bytes_per_s / GB:.1f} GB/s {pcie}",
                 f"CPU AdamW {self.cpu_params_per_s / 1e9:.1f} G params/s {o('cpu_params_per_s')}",
                 f"GPU {tflops:.0f} TFLOP/s {o('flops_per_s')}" if tflops >= 10 else
                 f"GPU {tflops:.2f} TFLOP/s {o('flops_per_s')}"]  # fmt: skip
        stated = any(o(name) == "stated" for name in RATES)
        return "rates: " + ", ".join(parts) + (f" ({self.source})" if stated else "")

    def to_json(self) -> dict[str, object]:
        """The rates in the units the config gives them, and the fields measured, given and stated."""
        return {"pcie_d2h_gb_per_s": round(self.pcie_d2h_bytes_per_s / GB, 3),
                "pcie_h2d_gb_per_s": round(self.pcie_h2d_bytes_per_s / GB, 3),
                "cpu_adam_g_params_per_s": round(self.cpu_params_per_s / 1e9, 4),
                "gpu_tflops": round(self.flops_per_s / 1e12, 3), "hbm_gb_per_s": round(self.hbm_bytes_per_s / GB, 1),
                **{kind: sorted(RATES[n].split(".")[1] for n in RATES if self.origin(n) == kind)
                   for kind in ("measured", "given", "stated")},
                "stated_source": self.source}  # fmt: skip


def default_costs(*, cuda: bool, precision: str) -> Costs:
    """The stated rates, the one place they are written. CUDA: an H200 (docs/BENCHMARKS.md): pinned copies
    measured 55.3 GB/s D2H and 55.4 H2D; the engine's CPU AdamW step 3.4-4.7 G params/s by lease (15 threads);
    bf16/fp16 matmuls 550 TFLOP/s achieved (the 13 B shape's fitting twin, 6N + 12 L h s per token); fp32
    without tensor cores ~50 TFLOP/s (stated, not measured); HBM 3 TB/s achieved for a streaming step (stated:
    4.8 TB/s peak); activation copies under compute show a fifth of their copy time (Llama-3-8B at seq 4096:
    7-8 offloaded layers whose copies compute covers cost 0.3-0.47 s a step, 18-25% of their copy time). CPU
    device (the tests): one host doing both sides, figures stated to order of magnitude."""
    if cuda:
        flops = 50e12 if precision == "fp32" else 550e12
        return Costs(55 * GB, 55 * GB, 4.0e9, flops, 3000 * GB, "stated H200 defaults", copy_share_under_compute=0.2)
    return Costs(10 * GB, 10 * GB, 1.0e9, 0.2e12, 20 * GB, "stated CPU defaults")


@dataclass(frozen=True)
class Workload:
    """What one step computes, whatever the mix: FLOPs of one micro-batch's forward, by layer and outside."""

    micro_batches: int
    layer_forward_flops: tuple[float, ...]  # cumulative: [i] = the first i layers' forward FLOPs (len L + 1)
    other_forward_flops: float  # embeddings, final norm, output head and loss
    flops_note: str = ""  # what the FLOPs leave out (a user's model: the attention scores)

    @classmethod
    def of_layers(cls, micro_batches: int, per_layer: list[float], other: float, note: str = "") -> Workload:
        acc, total = [0.0], 0.0
        for f in per_layer:
            total += f
            acc.append(total)
        return cls(micro_batches, tuple(acc), other, note)

    @property
    def n_layers(self) -> int:
        return len(self.layer_forward_flops) - 1

    @property
    def forward_flops(self) -> float:
        return self.layer_forward_flops[-1] + self.other_forward_flops

    def layers_flops(self, start: int, stop: int) -> float:
        """The forward FLOPs of layers start..stop-1 (one micro-batch)."""
        stop = max(start, min(stop, self.n_layers))
        return self.layer_forward_flops[stop] - self.layer_forward_flops[start]


@dataclass(frozen=True)
class Mix:
    """One candidate: what it offloads and recomputes, in the figures its memory plan states."""

    fraction: float
    offloaded_layers: int
    recomputed_layers: int  # layers offloaded_layers .. offloaded_layers + recomputed_layers - 1
    cpu_parameters: int
    gpu_parameters: int  # stepped on the GPU (by this rank)
    offloaded_bytes: int  # what the offloaded layers move to the host per micro-batch (each way)


@dataclass(frozen=True)
class Schedule:
    """How the optimizer step is scheduled (from the config)."""

    cpu_offload: bool
    overlap: bool  # optimizer.overlap_cpu_optimizer_d2h_h2d
    delayed: bool  # optimizer.delayed_param_update
    grad_bytes: int  # bytes of a gradient copied to the host
    weight_bytes: int  # bytes of a weight copied back
    gpu_step_bytes: int = GPU_STEP_BYTES  # device bytes the GPU side's step moves per parameter (gpu_side.py)


@dataclass(frozen=True)
class StepTime:
    """A mix's predicted step, in seconds, by part; `total_s` is what "auto" compares."""

    compute_s: float  # forward and backward without offloading, all micro-batches
    activation_copies_s: float  # offloaded layers' copies not hidden under compute
    recompute_s: float  # the recomputed layers' second forward
    gpu_step_s: float
    cpu_step_s: float  # the CPU step's whole time
    cpu_exposed_s: float  # of which not hidden by the schedule

    @property
    def total_s(self) -> float:
        return self.compute_s + self.activation_copies_s + self.recompute_s + self.gpu_step_s + self.cpu_exposed_s

    def to_json(self) -> dict[str, float]:
        """Milliseconds, to the microsecond."""
        parts = {"total": self.total_s, "compute": self.compute_s, "activation_copies": self.activation_copies_s,
                 "recompute": self.recompute_s, "gpu_step": self.gpu_step_s, "cpu_step": self.cpu_step_s,
                 "cpu_exposed": self.cpu_exposed_s}  # fmt: skip
        return {f"{k}_ms": round(1000 * v, 3) for k, v in parts.items()}


def step_time(w: Workload, m: Mix, s: Schedule, c: Costs) -> StepTime:
    """The predicted step of mix `m` (see the module docstring); O(1) whatever the depth."""
    fwd = w.forward_flops / c.flops_per_s
    bwd = 2 * fwd
    rec = w.layers_flops(m.offloaded_layers, m.offloaded_layers + m.recomputed_layers) / c.flops_per_s
    d2h, h2d = m.offloaded_bytes / c.pcie_d2h_bytes_per_s, m.offloaded_bytes / c.pcie_h2d_bytes_per_s
    h = c.copy_share_under_compute
    fwd_mb = max(fwd + h * d2h, d2h)
    bwd_mb = max(bwd + rec + h * h2d, h2d)
    n = w.micro_batches
    gpu_step = m.gpu_parameters * s.gpu_step_bytes / c.hbm_bytes_per_s
    cpu = m.cpu_parameters / c.cpu_params_per_s if s.cpu_offload else 0.0
    if not cpu:
        exposed = 0.0
    elif not s.overlap:
        copies = m.cpu_parameters * (s.grad_bytes / c.pcie_d2h_bytes_per_s + s.weight_bytes / c.pcie_h2d_bytes_per_s)
        exposed = cpu + copies
    elif s.delayed:
        exposed = max(0.0, cpu - n * (fwd_mb + bwd_mb) - gpu_step)
    else:
        total = m.cpu_parameters + m.gpu_parameters
        gpu_resident = fwd * (m.gpu_parameters / total if total else 1.0)
        exposed = max(0.0, cpu - gpu_step - gpu_resident)
    return StepTime(compute_s=n * 3 * fwd, activation_copies_s=n * (fwd_mb - fwd + bwd_mb - bwd - rec),
                    recompute_s=n * rec, gpu_step_s=gpu_step, cpu_step_s=cpu, cpu_exposed_s=exposed)  # fmt: skip
