"""The rows of `bin/bench scale` (one trained model each) and the table they print as."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field


@dataclass
class Row:
    name: str
    layers: int
    params: int
    fraction: float | str  # "auto" until the row's engine resolves it
    dpu: bool
    pin: bool = False
    iter_ms: float = 0.0
    tokens_per_s: float = 0.0
    tflops: float = 0.0
    vs_fit: float | None = None
    peak_gpu_bytes: int | None = None
    host_engine_bytes: int = 0
    host_rss_bytes: int = 0
    plan_gpu_bytes: int | None = None  # what the row's memory plan predicted (engine.initialize's pre-flight)
    plan_host_bytes: int | None = None
    cpu_params: int | None = None  # the parameters the CPU steps (the split is by whole tensors)
    cpu_step_ms: float | None = None
    cpu_pass_bytes: float | None = None  # per parameter through host memory, the C pass's (cpu_side.StepTiming)
    cpu_gbs: float | None = None  # the CPU step's GB/s through host memory: its parameters x pass bytes / its time
    speculated_ms: float | None = None
    guesses: str | None = None  # "committed/made" over the measured steps
    gpu_wait_ms: float | None = None
    exposed_ms: float | None = None
    hidden_ms: float | None = None
    overrides: dict = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)  # every iteration's, warm-up included
    measured_from: int = 0  # the first iteration iter_ms is the median from (a delayed row's: its first delayed one)
    delayed_steps: list[int] = field(default_factory=list)
    setup_s: float = 0.0
    unavailable: str | None = None


def count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _dram(r: Row) -> str:
    """' (18 B, 84 GB/s)': the CPU step's bytes per parameter through host memory and the rate it moved them."""
    return "" if r.cpu_gbs is None else f" ({r.cpu_pass_bytes:g} B, {r.cpu_gbs:.0f} GB/s)"


def table(rows: list[Row]) -> str:
    out = ["| run | layers | params | f | ms/iter | tokens/s | TFLOP/s | vs fit | peak GPU | host (engine) | host RSS "
           "| plan GPU | plan host | CPU step | before clip (guesses used) | GPU waited | hidden | exposed "
           "| loss first -> last |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        f = f"{r.fraction:.2f}" if isinstance(r.fraction, float) else r.fraction
        head = f"| {r.name} | {r.layers} | {count(r.params)} | {f} |"
        if r.unavailable:
            out.append(f"{head} not available: {r.unavailable} |")
            continue
        ms = lambda x: "-" if x is None else f"{x:.0f} ms"  # noqa: E731
        hid = ms(r.hidden_ms) + (f" ({r.hidden_ms / r.cpu_step_ms:.0%})" if r.hidden_ms is not None and
                                 r.cpu_step_ms else "")  # fmt: skip
        spec = "-" if r.speculated_ms is None else f"{r.speculated_ms:.0f} ms ({r.guesses})"
        out.append(f"{head} {r.iter_ms:.1f} | {r.tokens_per_s:,.0f} | {r.tflops:.4g} | "
                   f"{'-' if r.vs_fit is None else f'{r.vs_fit:.0%}'} | {_gib(r.peak_gpu_bytes)} | "
                   f"{_gib(r.host_engine_bytes)} | {_gib(r.host_rss_bytes)} | {_gib(r.plan_gpu_bytes)} | "
                   f"{_gib(r.plan_host_bytes)} | {ms(r.cpu_step_ms)}{_dram(r)} | {spec} | "
                   f"{ms(r.gpu_wait_ms)} | {hid} | {ms(r.exposed_ms)} | "
                   f"{r.losses[0]:.4f} -> {r.losses[-1]:.4f} |")  # fmt: skip
    return "\n".join(out)


def vs_fit(rows: list[Row], fit: Row, fit_shape, shape) -> None:
    """Each row's TFLOP/s over the fit row's, and its time beyond the fit row's scaled by the FLOP ratio."""
    scale = shape.flops_per_token()["total"] / fit_shape.flops_per_token()["total"]
    for r in rows:
        if r.unavailable:
            continue
        r.vs_fit = r.tflops / fit.tflops
        if r.cpu_step_ms is not None:
            r.exposed_ms = max(0.0, r.iter_ms - fit.iter_ms * scale)


def report(a: argparse.Namespace, argv: list[str], rows: list[Row], fit_shape, shape, formula: str, command: str
           ) -> None:  # fmt: skip
    """The formula, each shape's FLOPs per token, the table, the command, and --json."""
    fit = next((r for r in rows if r.name == "fit"), None)
    if fit is not None:
        vs_fit(rows, fit, fit_shape, shape)
    print()
    print(formula)
    for s in {s.layers: s for s in (fit_shape, shape) if s is not None}.values():
        f = s.flops_per_token()
        print(f"  L={s.layers}: N={s.matmul_params():,} -> {f['dense']:.4g} + {f['attention']:.4g} = "
              f"{f['total']:.4g} FLOPs/token (causal-counted: {f['causal_total']:.4g})")  # fmt: skip
    if fit_shape is not None:
        ratio = shape.flops_per_token()["total"] / fit_shape.flops_per_token()["total"]
        print("hidden = CPU step - GPU waited (CUDA events at each CPU-stepped unit's wait); exposed = ms/iter - the "
              f"fit row's ms/iter x the FLOP ratio ({ratio:.3f})")  # fmt: skip
    for name, over in a.variant:
        print(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in over.items()))
    print()
    print(table(rows))
    print(f"\ncommand: {command} {' '.join(argv)}".rstrip())
    write_json(a, rows, {"formula": formula, "argv": argv})


def write_json(a: argparse.Namespace, rows: list[Row], extra: dict | None = None) -> None:
    """--json: the rows so far (written after each row too, so a run stopped by a time limit keeps them)."""
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({**(extra or {"partial": True}), "rows": [asdict(r) for r in rows],
                       "depth_bounds": getattr(a, "depth_bounds", None)}, fh, indent=1)  # fmt: skip
