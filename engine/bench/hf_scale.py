"""`bin/bench scale --hf-config PATH|NAME`: bin/bench scale's rows for a HuggingFace causal LM.

The deep model is the config at its own depth (--layers N to choose another, or "auto": the deepest at which
every deep row's memory plan fits). Its twin (the fit row) is the same family at the deepest depth whose plan
fits without any offload (--layers-fit to choose), at the same sequence length, micro-batch and global batch:
the same tokens per step. Both depths come from the plan of the model at the probe depth (the config's, or
--layers), its first micro-batch measured as example_batch (engine.planning.batch), cut to fewer layers
(Census.truncated) and planned at each row's config against this machine's budgets (or --gpu-memory /
--host-memory). The probe model is freed before any row is built.

Each row builds its model from the config on the device in its training dtype (bf16 under the bench's
params_dtype="half"), from the same seed, gives engine.initialize its first micro-batch as `example_batch`, and
trains on byte tokens as {"input_ids", "labels"} (the model shifts the labels and computes its own loss).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from engine.bench import hf_models
from engine.bench.scale_rows import report
from engine.bench.scale_run import COMMAND, budgets, deep_rows, empty_caches, row_config, run_rows
from engine.data import TokenBatches, stdlib_bytes
from engine.planning import planner, resolve
from engine.planning.auto import NothingFits, Planner

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class HFShape:
    """A HF causal LM's config at one depth, with what the bench's rows need of a shape."""

    def __init__(self, label: str, shape: dict[str, Any], layers: int, seq: int) -> None:
        self.label, self.shape, self.layers, self.seq = label, shape, layers, seq
        self.config = hf_models.hf_config(shape, layers)
        meta = hf_models.meta_model(self.config)  # counts without storage
        self._params = sum(p.numel() for p in meta.parameters())
        self._flops = hf_models.flops_per_token(meta, self.config, seq)
        self.family = type(meta).__name__

    planned_at_a_batch = True  # its activations are measured at its first micro-batch (example_batch)

    def model_section(self) -> dict:
        return {}  # the model brings its shape; the built-in GPT's keys would be refused

    def params(self) -> int:
        return self._params

    def matmul_params(self) -> int:
        return self._flops["n"]

    def flops_per_token(self) -> dict[str, float]:
        return self._flops

    def build(self, device: torch.device, seed: int, cfg: dict) -> nn.Module:
        """The model with random weights on `device`, in the dtype the row's config trains its weights in."""
        t = cfg.get("train", {})
        dtype = _DTYPES[t.get("precision", "bf16")] if t.get("params_dtype") == "half" else torch.float32
        return hf_models.build(self.config, device, dtype, seed)

    def batches(self, tokens, micro_batch: int, seed: int) -> Iterator[dict]:
        """Endless micro-batches of byte tokens; labels are the inputs (the model shifts them)."""
        for ids, _ in TokenBatches(tokens, self.seq, micro_batch, seed):
            ids = ids.contiguous()
            yield {"input_ids": ids, "labels": ids}


def depth_bound(a: argparse.Namespace, cfg: dict, model: nn.Module, batch: Any) -> int:
    """The deepest depth, up to the model's, at which the plan of `cfg` fits (its "auto" values chosen); 0 if
    not even one layer does. Memory falls with depth, so a binary search over cut-down censuses."""
    b = budgets(a)
    p = planner(cfg, model, gpu_budget_bytes=b.gpu_bytes, host_budget_bytes=b.host_bytes, device=a.device,
                example_batch=batch)  # fmt: skip
    census = p.census

    def fits(depth: int) -> bool:
        trial = Planner(p.cfg, census.truncated(depth, p.settings.weight_elem), p.settings, cuda=p.cuda,
                        gpu_budget=p.gpu_budget, host_budget=p.host_budget)  # fmt: skip
        try:
            return resolve(trial).fits  # the config's values, its "auto" ones chosen, as initialize would
        except NothingFits:
            return False

    lo, hi = 0, census.n_layers
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_depths(a: argparse.Namespace, probe: HFShape, deep: list[tuple], tokens) -> tuple[int | None, int | None]:
    """(deep depth for --layers auto, twin depth when the fit row is wanted and --layers-fit not given), from
    the probe model's plans; prints each row's bound. The probe model is freed before returning."""

    device = torch.device(a.device)
    cfg = row_config(a, probe, 0.0, False)
    model = probe.build(device, a.seed, cfg)
    batch = next(probe.batches(tokens, a.micro_batch, a.seed))
    deep_layers = fit_layers = None
    try:
        if a.layers == "auto":
            bounds = {name: depth_bound(a, row_config(a, probe, f, dpu, over, pin), model, batch)
                      for name, _, f, dpu, pin, over in deep}  # fmt: skip
            deep_layers = min(bounds.values(), default=probe.layers)
            a.depth_bounds = bounds  # for --json
            print(f"--layers auto: the plan fits, of {probe.layers} layers, "
                  + ", ".join(f"{n}: {d}" for n, d in bounds.items())
                  + f"; every deep row runs at {deep_layers} (the fewest)", flush=True)  # fmt: skip
        if "fit" in a.rows.split(",") and a.layers_fit is None:
            fit_layers = depth_bound(a, cfg, model, batch)
            print(f"twin: the plan fits {fit_layers} of {probe.layers} layers without offload", flush=True)
    finally:
        del model, batch
        empty_caches()
    return deep_layers, fit_layers


def main(a: argparse.Namespace, argv: list[str]) -> int:
    """bin/bench scale with --hf-config (the flags already parsed and checked by engine.bench.scale)."""

    try:
        shape = hf_models.shape_of(a.hf_config)
        top = int(a.layers) if a.layers not in (None, "auto") else int(shape.get("num_hidden_layers", 0))
        probe = HFShape(a.hf_config, shape, top, a.seq)
    except ImportError:
        print(f"{COMMAND}: --hf-config needs transformers (pip install .[hf])", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"{COMMAND}: {e}", file=sys.stderr)
        return 2
    fraction = a.fraction if a.fraction == "auto" else float(a.fraction)
    tokens = stdlib_bytes(a.data_bytes)
    wants_fit = "fit" in a.rows.split(",")
    deep_layers, fit_layers = top, a.layers_fit
    if a.layers == "auto" or (wants_fit and fit_layers is None):
        planned_deep, planned_fit = plan_depths(a, probe, deep_rows(a, probe, fraction), tokens)
        deep_layers = planned_deep if planned_deep is not None else top
        fit_layers = planned_fit if fit_layers is None else fit_layers
    if deep_layers == 0 or fit_layers == 0:
        print(f"{COMMAND}: not even one layer of {a.hf_config} fits the plan at seq {a.seq}, micro-batch "
              f"{a.micro_batch}; lower --seq or --micro-batch", file=sys.stderr)  # fmt: skip
        return 2
    shape_deep = probe if deep_layers == top else HFShape(a.hf_config, shape, deep_layers, a.seq)
    fit_shape = HFShape(a.hf_config, shape, fit_layers, a.seq) if wants_fit else None
    device = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(f"{COMMAND}: {a.hf_config} ({shape_deep.family}), seq {a.seq}, micro-batch {a.micro_batch}, global batch "
          f"{a.global_batch}, weights in their training dtype, fp32 master + AdamW states; {a.warmup} warm-up + "
          f"{a.iters} measured iterations per row (median); {device}", flush=True)  # fmt: skip
    fit = [("fit", fit_shape, 0.0, False, False, {})] if fit_shape is not None else []
    rows = run_rows(a, fit + deep_rows(a, shape_deep, fraction), tokens)
    report(a, argv, rows, fit_shape, shape_deep, hf_models.FORMULA, COMMAND)
    return 0
