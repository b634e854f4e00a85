"""The shipped recipes train: every config in configs/ and each bench scale row, at a tiny shape on the CPU
with the recipe's own lr, warm-up, schedule, clipping and precision, lowers the loss over its first 10
iterations; and at its real width the first step stays small against the initial weights."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from engine.bench import scale
from engine.config import load_config
from engine.engine import initialize
from engine.schedule import lr_at

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.json"))
TINY_SHAPE = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=2", "model.seq_length=64",
              "train.device=cpu", "train.global_batch_size=4", "train.micro_batch_size=2",
              "logging.metrics_file=null", "logging.progress_bar=false", "data.max_bytes=1048576",
              "checkpoint.save=null"]  # fmt: skip


def falls(losses: list[float]) -> bool:
    return losses[-1] < losses[0] and statistics.mean(losses[-3:]) < statistics.mean(losses[:3])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_shipped_config_lowers_the_loss_over_10_iterations(path):
    eng, _, _ = initialize(config=str(path), overrides=TINY_SHAPE)
    losses = [eng.train_batch() for _ in range(10)]
    assert falls(losses), f"{path.name}: {losses}"


def test_each_bench_scale_row_lowers_the_loss_over_10_iterations(tmp_path):
    out = tmp_path / "scale.json"
    argv = ["--layers-fit", "2", "--layers", "3", "--hidden", "64", "--seq", "32", "--global-batch", "4",
            "--warmup", "1", "--iters", "9", "--data-bytes", "1000000", "--device", "cpu"]  # fmt: skip
    argv += ["--json", str(out)]
    assert scale.main(argv) == 0
    rows = json.load(open(out))["rows"]
    assert {r["name"] for r in rows} == {"fit", "exact", "dpu"}
    for r in rows:
        assert len(r["losses"]) == 10 and falls(r["losses"]), (r["name"], r["losses"])


def first_step_reach(lr: float, warmup: int, hidden: int, init_std: float, decay_iters: int, style: str) -> float:
    """How far Adam's first step moves a layer's output, against what the initial weights give it: the first
    step moves every weight by about lr_at(1), coherently across a fan-in of `hidden` (so ~lr_at(1) * hidden),
    where the initial weights contribute ~init_std * sqrt(hidden)."""
    first = lr_at(1, lr=lr, min_lr=0.0, warmup_iters=warmup, decay_iters=decay_iters, style=style)
    return first * math.sqrt(hidden) / init_std


# Measured: 0.54 (the 13 B demo at lr 3e-4, 2 warm-up steps) and 0.32 (bench scale at 8 B, lr 1e-4 without
# warm-up) made the loss rise on the H200; 0.17 (hidden 512 at lr 3e-4, 2 warm-up steps) still fell on the CPU.
MAX_REACH = 0.1


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_shipped_config_starts_with_a_small_step_at_its_width(path):
    c = load_config(str(path))
    o, m = c.optimizer, c.model
    reach = first_step_reach(o.lr, o.lr_warmup_iters, m.hidden_size, m.init_method_std,
                             o.lr_decay_iters or c.train.train_iters, o.lr_decay_style)  # fmt: skip
    assert reach <= MAX_REACH, f"{path.name}: raise optimizer.lr_warmup_iters or lower optimizer.lr ({reach:.2f})"


def test_bench_scale_starts_with_a_small_step_at_its_width():
    a = scale.parse_args([])
    cfg = load_config(scale._config(a, scale.Shape(a.layers, a.hidden, a.hidden // 128, a.seq), 0.3, False))
    o = cfg.optimizer
    reach = first_step_reach(o.lr, o.lr_warmup_iters, a.hidden, cfg.model.init_method_std, 10**6, o.lr_decay_style)
    assert reach <= MAX_REACH, reach
